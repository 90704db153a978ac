"""``mixprec ckpt show PATH``: verify a checkpoint and print what it holds (``lab/cli.py`` registers it).

    mixprec ckpt show run/step_1000.ckpt          # recipe, steps, loss scale, tensors by role
    mixprec ckpt show run/step_1000.ckpt --json   # the same as JSON, for scripts

A missing, truncated or altered file is one line on stderr and exit status 2, like every usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..checkpoint.verified import CheckpointError
from ..checkpoint.read import read_checkpoint
from .cli_args import UsageError

__all__ = ["add_parser", "handle"]


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``ckpt`` (with its ``show`` action) to ``mixprec``'s subcommands."""
    ckpt = commands.add_parser(
        "ckpt", help="open a checkpoint written by save_checkpoint: verify it and show what it holds",
        description="Checkpoints written by mixprec.save_checkpoint carry a checksummed header, so "
                    "torch.load cannot open them; this can (mixprec.read_checkpoint in Python).")
    actions = ckpt.add_subparsers(title="actions", dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="verify the checksum and print recipe, steps, loss scale and "
                                           "the tensors by role (model, optimizer, master weights, ...)")
    show.add_argument("path", type=Path, metavar="PATH", help="a file written by save_checkpoint")
    show.add_argument("--json", action="store_true", help="print JSON instead of the summary")
    show.add_argument("--trust", action="store_true",
                      help="load extras that hold arbitrary Python objects (torch.load weights_only=False): "
                           "only for files you trust")
    show.set_defaults(handler=handle)
    return ckpt


def handle(args: argparse.Namespace) -> int:
    """Read and verify the file, then print its summary (or JSON)."""
    try:
        info = read_checkpoint(args.path, weights_only=not args.trust)
    except CheckpointError as e:
        message = str(e).replace("load_checkpoint(..., weights_only=False)", "`mixprec ckpt show --trust`")
        raise UsageError(message) from e
    if args.json:
        data = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name not in ("state", "groups")}
        data["path"] = str(info.path)
        data["groups"] = [dataclasses.asdict(g) for g in info.groups]
        print(json.dumps(data, indent=1))
    else:
        print(info.summary())
    return 0

"""``mixprec inspect``: its parser and handler (``lab/cli.py`` registers them).

    mixprec inspect --benchmark gpt2 --json gpt2.json       # memory per recipe, tensor-core fit; no training
    mixprec inspect --workload gpt --out runs/inspect       # runs/inspect/inspect.json and inspect.html
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_args import (EXIT_INTERRUPTED, add_device_arg, add_workload_args, check_outputs, interrupts_deferred, recipe_words,
                        usage_errors, write_json)
from ..console import stdout_console
from ..compare.run import DEFAULT_RECIPES
from .render import render_matmul_table, render_memory_table, render_notes
from .run import plan_inspect, run_inspect

__all__ = ["add_parser", "handle"]


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``inspect`` to ``mixprec``'s subcommands; its handler is ``handle``."""
    inspect = commands.add_parser(
        "inspect", help="memory per recipe and the matmuls that miss tensor cores, without training",
        description="Trace one training step of a workload without allocating its model: predicted "
                    "memory by role per recipe (measured beside it where the model fits: built-in "
                    "workloads, or any on a GPU) and every matmul/convolution with its FLOPs, flagging "
                    "dimensions that are not multiples of 8 (fp16/bf16) or 16 (fp8), with the padding "
                    "that fixes them.")
    add_workload_args(inspect, "(predicted only on a CPU)")
    inspect.add_argument("--recipes", nargs="+", metavar="RECIPE", default=None,
                         help=f"recipes as for compare (default: {','.join(DEFAULT_RECIPES)})")
    add_device_arg(inspect)
    inspect.add_argument("--batch-size", type=int, default=None,
                         help="batch to trace (default: the workload's); try one that is a multiple of 8")
    inspect.add_argument("--json", metavar="PATH", type=Path, default=None,
                         help="also write the report as JSON to PATH (schema: mixprec.lab.inspect.report)")
    inspect.add_argument("--out", metavar="DIR", type=Path, default=None,
                         help="write DIR/inspect.json and DIR/inspect.html (a self-contained page: memory by "
                              "role per recipe, the matmul table and the padding fixes); DIR is created if "
                              "missing")
    inspect.set_defaults(handler=handle)
    return inspect


def handle(args: argparse.Namespace) -> int:
    """Trace and predict (measure where the plan says), write the JSON, print both tables and the notes."""
    with usage_errors():
        plan = plan_inspect(args.benchmark or args.workload, recipe_words(args.recipes, DEFAULT_RECIPES),
                            device=args.device, batch_size=args.batch_size)
        check_outputs(args.json, args.out, ("inspect.json", "inspect.html"))
        report = run_inspect(plan)    # traces; a model that cannot be traced is a ValueError saying so
    with interrupts_deferred() as interrupts:     # the files and tables are written whole, then a Ctrl-C stops
        write_json(report.to_json(), args.json, args.out, "inspect.json")
        if args.out is not None:
            from .html import render_inspect_html    # matplotlib: only when a page is asked for
            path = args.out / "inspect.html"
            path.write_bytes(render_inspect_html(report).encode("utf-8"))
            print(f"HTML page written to {path}", file=sys.stderr)
        out = stdout_console()      # full values in a pipe (lab/console.py)
        out.print(render_memory_table(report))
        out.print(render_matmul_table(report))
        for line in render_notes(report):
            out.print(line, soft_wrap=True)
    return EXIT_INTERRUPTED if interrupts.pressed else 0

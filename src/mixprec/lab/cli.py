"""The ``mixprec`` command line: thin wiring from words to the lab, and from reports to the console.

    mixprec compare                                  # mlp under fp32, fp16, bf16, fp16-pure
    mixprec compare --recipes fp32,bf16 --steps 300 --device cpu --json runs/compare.json
    mixprec compare --recipes fp32 params=bf16,compute=bf16,rounding=stochastic

Progress goes to stderr, the table to stdout, the report (data) to ``--json``. A user mistake prints one
line, ``mixprec: error: <what and how to fix it>``, and exits with status 2; everything is checked
before any training starts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import __version__
from .compare import DEFAULT_RECIPES, ComparePlan, plan_compare, run_compare
from .report import CompareReport, render_notes, render_table, short_names
from .trainer import TrainProgress
from .workloads import WORKLOADS

__all__ = ["main"]

_USAGE_ERROR = 2
_INTERRUPTED = 130


class _UsageError(Exception):
    """A user mistake found while checking the command; its message says how to fix it."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mixprec`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    try:
        args = _parser().parse_args(argv)
        return args.handler(args)
    except SystemExit as e:            # --help and --version exit through argparse
        return e.code if isinstance(e.code, int) else 0
    except (_UsageError, OSError) as e:
        # User mistakes (bad words, unwritable paths) arrive here with the fix in the message. Errors
        # raised while training are not caught: they are bugs and keep their traceback.
        message = " ".join(str(e).split())
        print(f"mixprec: error: {message}", file=sys.stderr)
        return _USAGE_ERROR
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return _INTERRUPTED


# ---------------------------------------------------------------------------------------- parsing
class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument raises ValueError so main prints it as one line like every error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixprec", description="Mixed-precision training that shows where precision "
                                                 "hurts.")
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    compare = commands.add_parser(
        "compare", help="train a built-in workload under several recipes and compare them",
        description="Train a built-in workload under each recipe from the same initial weights and "
                    "data order; print final train loss, test accuracy, samples/s, skipped steps and "
                    "the final loss scale.")
    compare.add_argument("--workload", default="mlp",
                         help=f"built-in workload: {', '.join(WORKLOADS)} (default: mlp)")
    compare.add_argument("--recipes", nargs="+", metavar="RECIPE", default=None,
                         help="recipe names and/or full recipe strings, joined by commas or spaces, "
                              "e.g. fp32,bf16,params=bf16,compute=bf16,rounding=stochastic "
                              f"(default: {','.join(DEFAULT_RECIPES)})")
    compare.add_argument("--steps", type=int, default=None,
                         help="optimizer steps per recipe (default: the workload's, 500 for mlp)")
    compare.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    compare.add_argument("--seed", type=int, default=0,
                         help="fixes the initial weights and minibatch order (default: 0)")
    compare.add_argument("--eval-every", type=int, default=None, metavar="K",
                         help="measure the test metric every K steps (default: ten times per run)")
    compare.add_argument("--json", metavar="PATH", type=Path, default=None,
                         help="also write the report as JSON to PATH")
    compare.add_argument("--threads", type=int, default=None,
                         help="torch CPU threads (default: torch's own choice; 1 keeps the small built-in "
                              "workloads steady on a machine where other processes hold cores)")
    compare.set_defaults(handler=_compare)
    # doctor, inspect and report join here as their lab modules land.
    return parser


def _recipe_words(values: Sequence[str] | None) -> list[str]:
    """Split ``--recipes`` words into recipe specs for ``get_recipe``.

    Names are joined by commas; a full recipe string's commas separate its keys, so consecutive
    ``key=value`` items form one recipe until a key repeats::

        ["fp32,params=bf16,compute=bf16,fp16"] -> ["fp32", "params=bf16,compute=bf16", "fp16"]
    """
    if values is None:
        return list(DEFAULT_RECIPES)
    specs: list[str] = []
    for value in values:
        group: list[str] = []           # key=value items of the recipe string being read
        for item in _top_level_items(value):
            key, is_pair, _ = item.partition("=")
            if is_pair and key.strip() not in {g.partition("=")[0].strip() for g in group}:
                group.append(item)
                continue
            if group:
                specs.append(",".join(group))
            group = [item] if is_pair else []
            if not is_pair:
                specs.append(item)
        if group:
            specs.append(",".join(group))
    return specs


def _top_level_items(text: str) -> list[str]:
    """``text`` split at commas outside parentheses (``scale=dynamic(init=1024,growth=2)`` stays whole)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


# ---------------------------------------------------------------------------------------- compare
def _compare(args: argparse.Namespace) -> int:
    try:
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        plan = plan_compare(args.workload, _recipe_words(args.recipes), steps=args.steps,
                            device=args.device, seed=args.seed, eval_every=args.eval_every)
        if args.json is not None:
            _check_writable(args.json)
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from e

    # torch's thread count is process-global: set for the runs, restored for whoever called main().
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or saved_threads)
    try:
        report = _run_with_progress(plan, Console(stderr=True))
    finally:
        torch.set_num_threads(saved_threads)

    if args.json is not None:
        args.json.write_text(report.to_json() + "\n")
        print(f"report written to {args.json}", file=sys.stderr)
    out = Console(highlight=False)
    out.print(render_table(report))
    for note in render_notes(report):
        out.print(note, soft_wrap=True)
    return 0


def _run_with_progress(plan: ComparePlan, console: Console) -> CompareReport:
    """``run_compare`` with a bar per recipe: steps, last loss, samples/s, elapsed."""
    names = short_names((str(r), r.label) for r in plan.recipes)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} samples/s"),
                  TimeElapsedColumn(), console=console) as progress:
        tasks = [progress.add_task(names[str(r)], total=plan.steps, start=False, loss="-", speed="-")
                 for r in plan.recipes]

        def on_progress(run: int, p: TrainProgress) -> None:
            if p.step == 0:
                progress.start_task(tasks[run])   # a bar's clock starts with its run
                return
            speed = f"{p.samples_per_s:,.0f}" if math.isfinite(p.samples_per_s) else "-"
            progress.update(tasks[run], completed=p.step, loss=f"{p.loss:.4f}", speed=speed)

        return run_compare(plan, on_progress)


def _check_writable(path: Path) -> None:
    """Fail now, not after training, if the report cannot be written to ``path``."""
    if path.is_dir():
        raise ValueError(f"--json {path} is a directory; give a file path, e.g. "
                         f"--json {path / 'compare.json'}")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"--json {path}: directory {parent} does not exist; create it (mkdir -p {parent}) "
                         "or choose another path")
    existed = path.exists()
    try:
        # Open for append: proves we may write there without truncating an existing file now.
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"--json {path} is not writable ({e.strerror}); choose a path in a writable "
                         "directory") from None
    if not existed:
        os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())

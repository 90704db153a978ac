"""The ``mixprec`` command line: thin wiring from words to the lab, and from reports to the console.

    mixprec compare                                  # mlp under fp32, fp16, bf16, fp16-pure
    mixprec compare --recipes fp32,bf16 --steps 300 --device cpu --json runs/compare.json
    mixprec compare --recipes fp32 params=bf16,compute=bf16,rounding=stochastic
    mixprec compare --steps 200 --out runs/today      # runs/today/report.json and report.html
    mixprec report runs/today/report.json --out page.html   # the page again, from the JSON alone
    mixprec inspect --benchmark gpt2 --json gpt2.json       # memory per recipe, tensor-core fit; no training
    mixprec ckpt show run/step_1000.ckpt              # verify a checkpoint, print what it holds
    mixprec plan --workload gpt --target h100         # the fastest per-layer recipe, verified

Progress goes to stderr, the table to stdout, the report (data) to ``--json`` or ``--out DIR`` (with its
HTML page beside it), and the paths written to stderr; a Python warning shows as one line, ``mixprec: note:
<message> (<Category>)``. A user mistake prints one line,
``mixprec: error: <what and how to fix it>``, and exits with status 2; everything is checked before any
training starts. A compare in which every recipe failed (each run skipped all its steps for inf/NaN
gradients) prints its table and exits with status 1: there is no result to read. A failure while training (a bug in the user's model) is one line too, naming the
workload, module and op; ``--traceback`` (anywhere on the line) or ``MIXPREC_TRACEBACK=1`` shows it all.

Each tool lives in its own subpackage, shaped the same way: ``run.py`` (plan and run), ``report.py`` (the
report dataclass; its JSON through ``lab/codec.py``), ``render.py`` (the console tables; ``html.py`` for
a page), ``cli.py`` (``add_parser`` and ``handle``). This module only assembles their parsers and
dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from . import checkpoint_cli
from .cli_args import EXIT_INTERRUPTED, UsageError
from .compare import cli as compare_cli
from .console import warnings_as_notes
from .doctor import cli as doctor_cli
from .failure import describe_failure, wants_traceback
from .inspect import cli as inspect_cli
from .plan import cli as plan_cli
from .trace import cli as trace_cli

__all__ = ["main"]

_USAGE_ERROR = 2
_INTERRUPTED = EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mixprec`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    full_traceback, argv = wants_traceback(list(sys.argv[1:] if argv is None else argv))
    args = None
    try:
        args = _parser().parse_args(argv)
        with warnings_as_notes():          # a warning is one line of ours, not a path and a source line
            return args.handler(args)
    except SystemExit as e:            # --help and --version exit through argparse
        return e.code if isinstance(e.code, int) else 0
    except (UsageError, OSError) as e:
        # User mistakes (bad words, unwritable paths) arrive here with the fix in the message.
        message = " ".join(str(e).split())
        print(f"mixprec: error: {message}", file=sys.stderr)
        return _USAGE_ERROR
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return _INTERRUPTED
    except Exception as e:
        # A failure while training (most often in the user's own model): one line naming the
        # workload, module and op (lab/failure.py); --traceback or MIXPREC_TRACEBACK=1 for all of it.
        if full_traceback:
            raise
        workload = getattr(args, "benchmark", None) or getattr(args, "workload", None)
        print(f"mixprec: error: {describe_failure(e, workload)}", file=sys.stderr)
        return _USAGE_ERROR


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument raises UsageError so main prints it as one line like every error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixprec", description="Mixed-precision training that shows where precision "
                                                 "hurts.")
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    # The order of `mixprec --help`: each add_parser sets its own handler.
    compare_cli.add_parser(commands)
    compare_cli.add_report_parser(commands)
    trace_cli.add_parser(commands)
    inspect_cli.add_parser(commands)
    doctor_cli.add_parser(commands)
    plan_cli.add_parser(commands)
    checkpoint_cli.add_parser(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())

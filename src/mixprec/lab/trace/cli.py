"""``mixprec trace``: its parser and handler (``lab/cli.py`` registers them).

    mixprec trace --workload gpt --recipe bf16,fp32_ops=layer_norm,modules=lm_head:fp32
    mixprec trace --workload cnn --recipe fp16-pure --json trace.json
    mixprec trace --workload gpt --out runs/trace     # runs/trace/trace.json and trace.html

The table goes to stdout, the report (``TraceReport.to_json``) to ``--json`` or ``--out DIR`` (with its
HTML page, ``trace/html.py``, beside it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_args import (EXIT_INTERRUPTED, add_device_arg, add_workload_args, check_outputs, interrupts_deferred,
                        usage_errors, write_json)
from ..console import stdout_console
from .render import render_trace
from .run import plan_trace, run_trace

__all__ = ["add_parser", "handle"]


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``trace`` to ``mixprec``'s subcommands; its handler is ``handle``."""
    trace = commands.add_parser(
        "trace", help="show which op ran in which dtype, per module, for one forward and backward",
        description="Run one forward and backward of a workload's first batch under a recipe and list "
                    "every op (aten name) with its input and output dtypes, grouped by module. View "
                    "ops are left out; casts show as _to_copy.")
    add_workload_args(trace, "(synthetic data at realistic sizes)")
    trace.add_argument("--recipe", default="bf16",
                       help="a recipe name or string, e.g. bf16,fp32_ops=softmax+layer_norm,"
                            "modules=lm_head:fp32 (default: bf16)")
    add_device_arg(trace)
    trace.add_argument("--batch-size", type=int, default=None,
                       help="rows in the traced batch (default: the workload's batch size)")
    trace.add_argument("--seed", type=int, default=0, help="fixes the initial weights (default: 0)")
    trace.add_argument("--json", metavar="PATH", type=Path, default=None,
                       help="also write the trace as JSON to PATH")
    trace.add_argument("--out", metavar="DIR", type=Path, default=None,
                       help="write DIR/trace.json and DIR/trace.html (a self-contained page with the per-module "
                            "dtype table); DIR is created if missing")
    trace.set_defaults(handler=handle)
    return trace


def handle(args: argparse.Namespace) -> int:
    """Check every input before tracing; trace; write the JSON; print the table."""
    with usage_errors():
        if args.batch_size is not None and args.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
        plan = plan_trace(args.benchmark or args.workload, args.recipe, device=args.device,
                          batch_size=args.batch_size, seed=args.seed)
        check_outputs(args.json, args.out, ("trace.json", "trace.html"))
    report = run_trace(plan)
    with interrupts_deferred() as interrupts:     # the files and the table are written whole, then a Ctrl-C stops
        write_json(report.to_json(), args.json, args.out, "trace.json")
        if args.out is not None:
            from .html import render_trace_html
            path = args.out / "trace.html"
            path.write_bytes(render_trace_html(report).encode("utf-8"))
            print(f"HTML page written to {path}", file=sys.stderr)
        out = stdout_console()
        if not out.is_terminal:
            out.width = max(out.width, 112)   # piped: room for aten names such as native_layer_norm_backward
        out.print(render_trace(report, plan.recipe))
    return EXIT_INTERRUPTED if interrupts.pressed else 0

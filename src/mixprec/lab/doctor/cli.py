"""``mixprec doctor``: its parser and handler (``lab/cli.py`` registers them).

    mixprec doctor --workload mlp                      # fp16 (dynamic scale), 20 steps, the table
    mixprec doctor --workload deep --recipe fp32 --steps 50 --out runs/doctor   # + doctor.json/.html
    mixprec doctor --workload gpt --modules blocks.0 --json gpt.json
    mixprec doctor --workload gpt --what-if --out runs/what-if   # + each linear in fp8/fp4 formats

Progress goes to stderr, the table and findings to stdout, the report to ``--json`` and/or ``--out
DIR`` (``DIR/doctor.json`` and ``DIR/doctor.html``). Mistakes are one line, ``mixprec: error: ...``,
exit status 2, found before anything trains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..cli_args import (EXIT_INTERRUPTED, add_device_arg, check_outputs, interrupts_deferred, torch_threads,
                        usage_errors, write_json)
from .run import DEFAULT_RECIPE, DEFAULT_STEPS, DoctorPlan, plan_doctor, run_doctor
from .render_fp8 import fp8_swap_lines, render_fp8_findings, render_fp8_table
from .render import render_doctor_table, render_findings
from .render_what_if import render_what_if_table, what_if_lines
from .what_if_report import DEFAULT_FLOOR_DB, DEFAULT_MAX_ROWS, WhatIfOptions
from .report import DoctorReport
from ..trainer import TrainProgress
from ..workloads import BENCHMARKS, WORKLOADS
from ..console import stdout_console

__all__ = ["add_parser", "handle"]


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``doctor`` to ``mixprec``'s subcommands; its handler is ``handle``."""
    doctor = commands.add_parser(
        "doctor", help="per-layer numeric ranges: what underflows or overflows in which format",
        description="Train a workload a few steps under one recipe and measure, per module, the ranges "
                    "of activations, gradients (in true units), weights and updates: the exact share "
                    "each of fp16, bf16, fp8 e4m3 and e5m2 would flush, make subnormal or overflow; "
                    "updates that fp16/bf16 weights would lose; and the window of loss scales that fits "
                    "the gradients into fp16.")
    doctor.add_argument("--workload", default="mlp",
                        help=f"built-in workload ({', '.join(WORKLOADS)}; default mlp), a benchmark "
                             f"({', '.join(BENCHMARKS)}), or your own as package.module:function")
    doctor.add_argument("--recipe", default=DEFAULT_RECIPE,
                        help=f"one recipe name or string (default {DEFAULT_RECIPE}: its dynamic loss scale "
                             "lets the doctor see gradients fp16 alone would flush)")
    doctor.add_argument("--steps", type=int, default=None,
                        help=f"training steps, statistics collected on each (default {DEFAULT_STEPS})")
    add_device_arg(doctor)
    doctor.add_argument("--seed", type=int, default=0, help="initial weights and batch order (default 0)")
    doctor.add_argument("--modules", default=None, metavar="NAMES",
                        help="only these modules (and what they contain), comma-separated qualified "
                             "names as model.named_modules() prints them, e.g. blocks.0,lm_head")
    doctor.add_argument("--json", metavar="PATH", type=Path, default=None, help="write the report as JSON")
    doctor.add_argument("--out", metavar="DIR", type=Path, default=None,
                        help="write DIR/doctor.json and DIR/doctor.html (self-contained, with histograms)")
    doctor.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    doctor.add_argument("--what-if", action="store_true",
                        help="also measure, per linear layer on the last step's batch, what fp8 (per "
                             "tensor), fp8-rowwise, fp8-block, mxfp8 and nvfp4 would flush, saturate and "
                             "cost in SQNR against bf16, and advise the cheapest format each layer tolerates")
    doctor.add_argument("--what-if-floor", type=float, default=None, metavar="DB",
                        help=f"the SQNR (dB) of output and weight gradient a tolerated format must reach "
                             f"(default {DEFAULT_FLOOR_DB:g}; implies --what-if)")
    doctor.add_argument("--what-if-rows", type=int, default=None, metavar="N",
                        help=f"rows of each layer's input and output gradient measured (default "
                             f"{DEFAULT_MAX_ROWS}; more are cut to the first N; implies --what-if)")
    doctor.add_argument("--what-if-no-grad-snr", action="store_true",
                        help="leave out the end-to-end gradient SNR (one forward and backward of the whole "
                             "model per format and in fp32); implies --what-if")
    doctor.set_defaults(handler=handle)
    return doctor


def handle(args: argparse.Namespace) -> int:
    """Check everything, then train with the collector and print the table and findings."""
    with usage_errors():
        threads = torch_threads(args.threads)        # checks the count now; sets it for the run below
        plan = _plan(args)
    with threads:
        report = _run_with_progress(plan)
    with interrupts_deferred() as interrupts:      # a Ctrl-C now waits for whole files and tables
        status = _write_and_print(args, report)
    if interrupts.pressed:
        print("mixprec: interrupted after the run finished; the report, tables and page are complete",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return status


def _plan(args: argparse.Namespace) -> DoctorPlan:
    """Check the command's words and paths before training; ValueError/TypeError say what to fix."""
    modules = None if args.modules is None else args.modules.split(",")
    what_if = None
    if (args.what_if or args.what_if_floor is not None or args.what_if_rows is not None
            or args.what_if_no_grad_snr):
        what_if = WhatIfOptions(
            floor_db=DEFAULT_FLOOR_DB if args.what_if_floor is None else args.what_if_floor,
            max_rows=DEFAULT_MAX_ROWS if args.what_if_rows is None else args.what_if_rows,
            grad_snr=not args.what_if_no_grad_snr)
    plan = plan_doctor(args.workload, args.recipe, steps=args.steps, device=args.device, seed=args.seed,
                       modules=modules, what_if=what_if)
    check_outputs(args.json, args.out, ("doctor.json", "doctor.html"))
    return plan


def _run_with_progress(plan: DoctorPlan) -> DoctorReport:
    """``run_doctor`` with a progress bar on stderr: steps, last loss, elapsed."""
    with Progress(TextColumn(f"doctor {plan.workload.name} under {plan.recipe.label}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                  console=Console(stderr=True)) as progress:
        task = progress.add_task("", total=plan.steps, loss="-")

        def on_progress(p: TrainProgress) -> None:
            if p.step:
                progress.update(task, completed=p.step, loss=f"{p.loss:.4g}")

        return run_doctor(plan, on_progress)


def _write_and_print(args: argparse.Namespace, report: DoctorReport) -> int:
    """Write the report and page, print the table and findings."""
    write_json(report.to_json(), args.json, args.out, "doctor.json")
    if args.out is not None:
        _write_page(report, args.out / "doctor.html")
    out = stdout_console()      # full values in a pipe (lab/console.py)
    out.print(render_doctor_table(report))
    if report.fp8_swap is not None:       # fp8 recipes: the swap decisions, then each fp8 tensor
        for line in fp8_swap_lines(report.fp8_swap):
            out.print(line, soft_wrap=True)
        out.print(render_fp8_table(report))
    if report.what_if is not None:
        out.print(render_what_if_table(report))
    what_if = what_if_lines(report) if report.what_if is not None else []
    for line in render_findings(report) + render_fp8_findings(report) + what_if:
        out.print(f"- {line}", soft_wrap=True)
    return 0


def _write_page(report: DoctorReport, path: Path) -> None:
    from .html import render_doctor_html   # matplotlib: only when a page is asked for
    path.write_bytes(render_doctor_html(report).encode("utf-8"))
    print(f"HTML page written to {path}", file=sys.stderr)

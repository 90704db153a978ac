"""``mixprec plan``: its parser and handler (``lab/cli.py`` registers them).

    mixprec plan --workload gpt --target h100                 # the table and the recipe
    mixprec plan --workload mymod:make --target b200 --out runs/plan   # + plan.json and plan.html

Progress goes to stderr, the table and recipe to stdout, the report to ``--json`` and/or ``--out DIR``.
Mistakes (an unknown target, a model with no layer to plan, a workload that diverges in fp32) are one
line, ``mixprec: error: ...``, exit status 2. A plan whose verification never came inside the band
prints its table, names the layers and the gap, and exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...diagnostics.speed_model import TARGETS
from ..cli_args import UsageError, add_device_arg, check_outputs, torch_threads, usage_errors, write_json
from ..console import stdout_console
from ..workloads import BENCHMARKS, WORKLOADS
from .evidence import WorkloadDiverges
from .render import render_plan
from .run import DEFAULT_FLOOR_DB, DEFAULT_RETRIES, DEFAULT_STEPS, plan_setup, run_plan

__all__ = ["add_parser", "handle"]


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``plan`` to ``mixprec``'s subcommands; its handler is ``handle``."""
    plan = commands.add_parser(
        "plan", help="the fastest per-layer recipe that still trains like fp32, verified",
        description="Measure per linear layer what each low-precision format the target runs would do "
                    "(the doctor's what-if SQNRs), predict each layer's time per format on the target "
                    "(spec-sheet roofline), choose the fastest format per layer that passes, and verify "
                    "the recipe by training it lockstep with bf16 from one init: accepted only inside "
                    "fp32's seed-to-seed band.")
    plan.add_argument("--workload", default="gpt",
                      help=f"built-in workload ({', '.join(WORKLOADS)}; default gpt), a benchmark "
                           f"({', '.join(BENCHMARKS)}), or your own as package.module:function")
    plan.add_argument("--target", default="h100", help=f"the GPU to plan for: {', '.join(TARGETS)} (default h100)")
    plan.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                      help=f"lockstep steps per training run (default {DEFAULT_STEPS})")
    plan.add_argument("--seed", type=int, default=0, help="initial weights and batch order (default 0)")
    plan.add_argument("--floor-db", type=float, default=DEFAULT_FLOOR_DB,
                      help=f"SQNR (dB) of output and weight gradient a format must reach (default {DEFAULT_FLOOR_DB:g})")
    plan.add_argument("--budget", type=float, default=1.0,
                      help="how far the plan's loss may end from bf16's, in units of fp32's seed band (default 1)")
    plan.add_argument("--retries", type=int, default=DEFAULT_RETRIES,
                      help=f"verifications after the first, each raising the most sensitive layers (default {DEFAULT_RETRIES})")
    plan.add_argument("--contrast", metavar="FORMAT", default=None,
                      help="also train this one low format (current, rowwise, block, mxfp8, nvfp4) on every "
                           "planned layer that takes it, lockstep from the same init, and show it beside the "
                           "plan: what a per-layer choice buys (one more training run)")
    add_device_arg(plan)
    plan.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    plan.add_argument("--json", metavar="PATH", type=Path, default=None, help="write the report as JSON")
    plan.add_argument("--out", metavar="DIR", type=Path, default=None, help="write DIR/plan.json and DIR/plan.html")
    plan.set_defaults(handler=handle)
    return plan


def handle(args: argparse.Namespace) -> int:
    """Check everything, plan, write, print; 1 when no recipe came inside the band."""
    with usage_errors():
        threads = torch_threads(args.threads)
        setup = plan_setup(args.workload, target=args.target, steps=args.steps, seed=args.seed,
                           floor_db=args.floor_db, budget=args.budget, retries=args.retries, device=args.device,
                           contrast=args.contrast)
        check_outputs(args.json, args.out, ("plan.json", "plan.html"))
    with threads:
        try:
            report = run_plan(setup, lambda msg: print(f"plan: {msg}", file=sys.stderr))
        except WorkloadDiverges as e:            # found by the fp32 runs: a user's problem, one line
            raise UsageError(str(e)) from e
    write_json(report.to_json(), args.json, args.out, "plan.json")
    if args.out is not None:
        from .html import render_plan_html          # matplotlib: only when a page is asked for
        (args.out / "plan.html").write_text(render_plan_html(report))
        print(f"HTML page written to {args.out / 'plan.html'}", file=sys.stderr)
    out = stdout_console()
    out.print(render_plan(report))
    if not report.accepted:
        print("mixprec: no recipe met the budget: " + "; ".join(report.failing), file=sys.stderr)
        return 1
    print(report.recipe)
    return 0

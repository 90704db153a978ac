"""``mixprec compare`` and ``mixprec report``: their parsers and handlers (``lab/cli.py`` registers them).

    mixprec compare --recipes fp32,bf16 --steps 300 --device cpu --json runs/compare.json
    mixprec compare --steps 200 --out runs/today      # runs/today/report.json and report.html
    mixprec report runs/today/report.json --out page.html   # the page again, from the JSON alone
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ...recipe import get_recipe
from ..cli_args import (EXIT_FAILED, EXIT_INTERRUPTED, add_device_arg, add_workload_args, check_outputs, check_writable,
                        interrupts_deferred, recipe_words, torch_threads, usage_errors, write_json)
from ..console import stdout_console
from ..trainer import TrainProgress
from .render import failed, render_notes, render_table, short_names
from .report import CompareReport
from .run import DEFAULT_RECIPES, ComparePlan, plan_compare, run_compare

__all__ = ["add_parser", "handle", "add_report_parser", "handle_report"]


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``compare`` to ``mixprec``'s subcommands; its handler is ``handle``."""
    compare = commands.add_parser(
        "compare", help="train a built-in workload under several recipes and compare them",
        description="Train a built-in workload under each recipe from the same initial weights and "
                    "data order; print final train loss, test accuracy, samples/s, skipped steps and "
                    "the final loss scale.")
    add_workload_args(compare, "(synthetic data at realistic sizes, for speed and memory on a GPU)")
    compare.add_argument("--recipes", nargs="+", metavar="RECIPE", default=None,
                         help="recipe names and/or full recipe strings, joined by commas or spaces, "
                              "e.g. fp32,bf16,params=bf16,compute=bf16,rounding=stochastic "
                              f"(default: {','.join(DEFAULT_RECIPES)})")
    compare.add_argument("--steps", type=int, default=None,
                         help="optimizer steps per recipe (default: the workload's, 500 for mlp)")
    add_device_arg(compare)
    compare.add_argument("--seed", type=int, default=0,
                         help="fixes the initial weights and minibatch order (default: 0)")
    compare.add_argument("--eval-every", type=int, default=None, metavar="K",
                         help="measure the test metric every K steps (default: ten times per run)")
    compare.add_argument("--json", metavar="PATH", type=Path, default=None,
                         help="also write the report as JSON to PATH")
    compare.add_argument("--out", metavar="DIR", type=Path, default=None,
                         help="write DIR/report.json and DIR/report.html (a self-contained page with "
                              "plots); DIR is created if missing")
    compare.add_argument("--threads", type=int, default=None,
                         help="torch CPU threads (default: torch's own choice; 1 keeps the small built-in "
                              "workloads steady on a machine where other processes hold cores)")
    compare.add_argument("--nproc", type=int, default=1, metavar="N",
                         help="train each recipe on N processes (gloo on cpu, nccl with one GPU each), "
                              "every global batch split between them (default: 1)")
    compare.add_argument("--parallel", choices=["ddp", "fsdp"], default=None,
                         help="with --nproc > 1: DDP (replicated) or FSDP2 (sharded) (default: ddp)")
    compare.set_defaults(handler=handle)
    return compare


def handle(args: argparse.Namespace) -> int:
    """Check everything, train each recipe with a progress bar, write the report and page, print the table."""
    with usage_errors():
        threads = torch_threads(args.threads)        # checks the count now; sets it for the runs below
        if args.parallel is not None and args.nproc == 1:
            raise ValueError(f"--parallel {args.parallel} needs --nproc N with N > 1 (one process has "
                             f"nothing to shard or replicate), e.g. --nproc 2 --parallel {args.parallel}")
        plan = plan_compare(args.benchmark or args.workload, recipe_words(args.recipes, DEFAULT_RECIPES),
                            steps=args.steps, device=args.device, seed=args.seed, eval_every=args.eval_every,
                            nproc=args.nproc, parallel=args.parallel or "ddp")
        fp8 = [r.label for r in plan.recipes if r.fp8 is not None]
        if plan.nproc > 1 and fp8 and (args.parallel or "ddp") == "ddp":
            print(f"mixprec: note: {', '.join(fp8)} under --nproc {plan.nproc} (ddp) is untested: fp8 recipes "
                  "are tested under FSDP2 (--parallel fsdp, weights all-gathered in e4m3), not yet under DDP "
                  "(docs/distributed.md)", file=sys.stderr)
        check_outputs(args.json, args.out, ("report.json", "report.html"))
    note = slow_run_note(plan)
    if note:
        print(f"mixprec: note: {note}", file=sys.stderr)
    with threads:
        report = _run_with_progress(plan, Console(stderr=True))

    # Every recipe that will run has run: a Ctrl-C now waits until the report, page and table are whole.
    with interrupts_deferred() as interrupts:
        write_json(report.to_json(), args.json, args.out, "report.json")
        if args.out is not None:
            _write_page(report, args.out / "report.html")
        _print_table(report)
    if report.partial:
        print(f"mixprec: interrupted; kept the {len(report.runs)} recipe(s) that had taken steps, each at the "
              "steps it took (report marked partial)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if interrupts.pressed:
        # Not partial: every recipe finished before the Ctrl-C, and the files hold all of them.
        print(f"mixprec: interrupted after all {len(report.runs)} recipe(s) finished; the report, table and "
              "page are complete", file=sys.stderr)
        return EXIT_INTERRUPTED
    if report.runs and all(failed(report, r) for r in report.runs):
        # Nothing to compare: a script running compare must not read this as a result.
        print(f"mixprec: error: every recipe failed: all {report.steps} steps of each run were skipped for "
              "an inf/NaN gradient norm, so no run trained (see the notes above)", file=sys.stderr)
        return EXIT_FAILED
    return 0


def slow_run_note(plan: ComparePlan) -> str | None:
    """What to expect before a run that is silent for minutes: a GPU benchmark trained on a CPU."""
    if not plan.workload.synthetic or plan.device.type != "cpu":
        return None
    return (f"{plan.workload.name} is a benchmark sized for GPUs: on the CPU one step can take minutes, "
            f"and each recipe's bar moves only once its model is built and its first step is done "
            f"({len(plan.recipes)} recipe(s) x {plan.steps} step(s)); --device cuda is what it is for")


def add_report_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``report`` (compare's page again, from its JSON) to ``mixprec``'s subcommands."""
    report = commands.add_parser(
        "report", help="render the HTML page of a JSON report written by compare",
        description="Read a JSON report written by 'mixprec compare' (with --out or --json), write "
                    "its self-contained HTML page (no network needed to view it) and print its table.")
    report.add_argument("json", metavar="RUN.json", type=Path, help="the JSON report to render")
    report.add_argument("--out", metavar="PAGE.html", type=Path, default=None,
                        help="where to write the page (default: RUN.json's path with .html)")
    report.set_defaults(handler=handle_report)
    return report


def handle_report(args: argparse.Namespace) -> int:
    """Re-render a JSON report: its HTML page, and its table on stdout."""
    out = args.out if args.out is not None else args.json.with_suffix(".html")
    with usage_errors():
        if out.resolve() == args.json.resolve():
            raise ValueError(f"--out {out} is the report itself; give the page another name, e.g. "
                             f"--out {args.json.with_name(args.json.stem + '-page.html')}")
        try:
            text = args.json.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read {args.json} ({e.strerror}); give the path of a report written "
                             "by 'mixprec compare --out DIR' (DIR/report.json) or '--json PATH'") from None
        except UnicodeDecodeError:
            raise ValueError(f"{args.json} is not a mixprec report: it is not UTF-8 text") from None
        _refuse_other_kinds(args.json, text)
        report = CompareReport.from_json(text)
        for i, run in enumerate(report.runs):
            try:
                get_recipe(run.recipe)
            except ValueError as e:
                raise ValueError(f"{args.json}: runs[{i}].recipe: {e}") from None
        check_writable(out, "--out", fix=f"give a file path, e.g. --out {out / 'report.html'}")
    _write_page(report, out)
    _print_table(report)
    return 0


def _refuse_other_kinds(path: Path, text: str) -> None:
    """A doctor or inspect report handed to ``mixprec report``: say what it is and where its view is.

    The codec tags every report with its ``kind`` (lab/codec.py) and would refuse these too, but only
    as "not a compare report"; the user needs to hear which command shows this file instead.
    """
    try:
        kind = json.loads(text).get("kind")
    except (ValueError, AttributeError):
        return                            # not JSON, or not an object: from_json says so
    if kind == "doctor":
        raise ValueError(f"{path} is a doctor report ('mixprec report' renders compare reports): its "
                         f"page is {path.with_name('doctor.html')} when doctor ran with --out DIR; to "
                         "write it, run 'mixprec doctor ... --out DIR' again")
    if kind in ("inspect", "trace"):
        raise ValueError(f"{path} is {'an' if kind == 'inspect' else 'a'} {kind} report ('mixprec report' renders "
                         f"compare reports): its page is {path.with_name(kind + '.html')} when {kind} ran with "
                         f"--out DIR; to write it, run 'mixprec {kind} ... --out DIR' again")


def _print_table(report: CompareReport) -> None:
    out = stdout_console()      # full values in a pipe (lab/console.py)
    out.print(render_table(report))
    for note in render_notes(report):
        out.print(note, soft_wrap=True)


def _write_page(report: CompareReport, path: Path) -> None:
    # Imported here: matplotlib takes most of a second to import, and only pages need it.
    from .html import render_html
    # Bytes, not text: no newline translation, so a page re-rendered from the JSON is byte-identical.
    path.write_bytes(render_html(report).encode("utf-8"))
    print(f"HTML page written to {path}", file=sys.stderr)


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

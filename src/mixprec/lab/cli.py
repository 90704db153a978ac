"""The ``mixprec`` command line: thin wiring from words to the lab, and from reports to the console.

    mixprec compare                                  # mlp under fp32, fp16, bf16, fp16-pure
    mixprec compare --recipes fp32,bf16 --steps 300 --device cpu --json runs/compare.json
    mixprec compare --recipes fp32 params=bf16,compute=bf16,rounding=stochastic
    mixprec compare --steps 200 --out runs/today      # runs/today/report.json and report.html
    mixprec report runs/today/report.json --out page.html   # the page again, from the JSON alone
    mixprec inspect --benchmark gpt2 --json gpt2.json       # memory per recipe, tensor-core fit; no training

Progress goes to stderr, the table to stdout, the report (data) to ``--json`` or ``--out DIR`` (with its
HTML page beside it), and the paths written to stderr. A user mistake prints one line,
``mixprec: error: <what and how to fix it>``, and exits with status 2; everything is checked before any
training starts. A failure while training (a bug in the user's model) is one line too, naming the
workload, module and op; ``--traceback`` (anywhere on the line) or ``MIXPREC_TRACEBACK=1`` shows it all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import __version__
from ..recipe import get_recipe, split_top_level
from .console import stdout_console
from .failure import describe_failure, wants_traceback
from .compare import DEFAULT_RECIPES, ComparePlan, plan_compare, run_compare
from .doctor_cli import add_doctor_parser, plan_from_args, run_and_print
from .report import CompareReport, render_notes, render_table, short_names
from .trace import add_trace_parser, plan_trace
from .trainer import TrainProgress
from .cli_args import add_device_arg, add_workload_args

__all__ = ["main"]

_USAGE_ERROR = 2
_INTERRUPTED = 130


class _UsageError(Exception):
    """A user mistake found while checking the command; its message says how to fix it."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mixprec`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    full_traceback, argv = wants_traceback(list(sys.argv[1:] if argv is None else argv))
    args = None
    try:
        args = _parser().parse_args(argv)
        return args.handler(args)
    except SystemExit as e:            # --help and --version exit through argparse
        return e.code if isinstance(e.code, int) else 0
    except (_UsageError, OSError) as e:
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
    compare.set_defaults(handler=_compare)

    report = commands.add_parser(
        "report", help="render the HTML page of a JSON report written by compare",
        description="Read a JSON report written by 'mixprec compare' (with --out or --json), write "
                    "its self-contained HTML page (no network needed to view it) and print its table.")
    report.add_argument("json", metavar="RUN.json", type=Path, help="the JSON report to render")
    report.add_argument("--out", metavar="PAGE.html", type=Path, default=None,
                        help="where to write the page (default: RUN.json's path with .html)")
    report.set_defaults(handler=_report)
    add_trace_parser(commands)
    commands.choices["trace"].set_defaults(handler=_trace)
    _add_inspect(commands)
    add_doctor_parser(commands).set_defaults(handler=_doctor)
    return parser


def _add_inspect(commands) -> None:
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
                         help="also write the report as JSON to PATH (schema: mixprec.lab.inspect)")
    inspect.set_defaults(handler=_inspect)


def _recipe_words(values: Sequence[str] | None) -> list[str]:
    """Split ``--recipes`` words into recipe specs for ``get_recipe``.

    Names are joined by commas; a full recipe string's commas separate its keys, so consecutive
    ``key=value`` items form one recipe until a key repeats::

        ["fp32,params=bf16,compute=bf16,fp16"] -> ["fp32", "params=bf16,compute=bf16", "fp16"]
        ["fp32,bf16,fp32_ops=softmax"] -> ["fp32", "bf16,fp32_ops=softmax"]
        ["fp32,fp16,scale=static:1024"] -> ["fp32", "fp16,scale=static:1024"]
    """
    if values is None:
        return list(DEFAULT_RECIPES)
    specs: list[str] = []
    for value in values:
        group: list[str] = []           # key=value items of the recipe string being read
        for item in split_top_level(value):
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
    # Tweaking keys right after a name edit that named recipe: bf16,fp32_ops=softmax.
    merged: list[str] = []
    for spec in specs:
        keys = {item.partition("=")[0].strip() for item in split_top_level(spec)}
        if merged and "=" not in split_top_level(merged[-1])[0] and "=" in spec and keys <= _EDIT_KEYS:
            merged[-1] += "," + spec
        else:
            merged.append(spec)
    return merged


# Keys that tweak the named recipe before them (fp16,scale=static:1024; fp8-delayed,fp8=delayed(margin=1));
# params, compute and master start a recipe of their own (fp32,params=bf16,compute=bf16 is two).
_EDIT_KEYS = {"fp32_ops", "low_ops", "follow_ops", "modules", "scale", "fp8", "rounding", "fp32_modules"}


# ---------------------------------------------------------------------------------------- compare
def _compare(args: argparse.Namespace) -> int:
    try:
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        if args.parallel is not None and args.nproc == 1:
            raise ValueError(f"--parallel {args.parallel} needs --nproc N with N > 1 (one process has "
                             f"nothing to shard or replicate), e.g. --nproc 2 --parallel {args.parallel}")
        plan = plan_compare(args.benchmark or args.workload, _recipe_words(args.recipes), steps=args.steps,
                            device=args.device, seed=args.seed, eval_every=args.eval_every,
                            nproc=args.nproc, parallel=args.parallel or "ddp")
        fp8 = [r.label for r in plan.recipes if r.fp8 is not None]
        if plan.nproc > 1 and fp8:
            print(f"mixprec: note: {', '.join(fp8)} under --nproc {plan.nproc} is untested: fp8 recipes "
                  "are not yet covered under DDP or FSDP2 (README, Distributed)", file=sys.stderr)
        if args.json is not None:
            _check_writable(args.json, "--json")
        if args.out is not None:
            _make_out_dir(args.out)
            for name in ("report.json", "report.html"):
                _check_writable(args.out / name, "--out",
                                fix="remove it or choose another --out directory")
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from e

    # torch's thread count is process-global: set for the runs, restored for whoever called main().
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or saved_threads)
    try:
        report = _run_with_progress(plan, Console(stderr=True))
    finally:
        torch.set_num_threads(saved_threads)

    json_paths = [args.json] if args.json is not None else []
    if args.out is not None:
        json_paths.append(args.out / "report.json")
    for path in json_paths:
        path.write_text(report.to_json() + "\n")
        print(f"report written to {path}", file=sys.stderr)
    if args.out is not None:
        _write_page(report, args.out / "report.html")
    _print_table(report)
    if report.partial:
        print(f"mixprec: interrupted; kept the {len(report.runs)} recipe(s) that finished (report marked "
              "partial)", file=sys.stderr)
        return _INTERRUPTED
    return 0


def _print_table(report: CompareReport) -> None:
    out = stdout_console()
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


# ----------------------------------------------------------------------------------------- doctor
def _doctor(args: argparse.Namespace) -> int:
    """Per-layer ranges of one recipe on one workload (lab/doctor_cli.py does the work)."""
    try:
        plan = plan_from_args(args, _check_writable, _make_out_dir)
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from e
    return run_and_print(args, plan)


# ----------------------------------------------------------------------------------------- report
def _report(args: argparse.Namespace) -> int:
    """Re-render a JSON report: its HTML page, and its table on stdout."""
    out = args.out if args.out is not None else args.json.with_suffix(".html")
    try:
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
        _check_writable(out, "--out", fix=f"give a file path, e.g. --out {out / 'report.html'}")
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from e
    _write_page(report, out)
    _print_table(report)
    return 0


def _refuse_other_kinds(path: Path, text: str) -> None:
    """A doctor or inspect report handed to ``mixprec report``: say what it is, not a schema diff."""
    try:
        kind = json.loads(text).get("kind")
    except (ValueError, AttributeError):
        return                            # not JSON, or not an object: from_json says so
    if kind == "doctor":
        raise ValueError(f"{path} is a doctor report ('mixprec report' renders compare reports): its "
                         f"page is {path.with_name('doctor.html')} when doctor ran with --out DIR; to "
                         "write it, run 'mixprec doctor ... --out DIR' again")
    if kind == "inspect":
        raise ValueError(f"{path} is an inspect report ('mixprec report' renders compare reports); "
                         "'mixprec inspect' prints its tables, and the JSON is the data")


def _trace(args: argparse.Namespace) -> int:
    try:
        run = plan_trace(args, _check_writable)
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from e
    return run()
# ---------------------------------------------------------------------------------------- inspect
def _inspect(args: argparse.Namespace) -> int:
    from .inspect import plan_inspect, render_matmul_table, render_memory_table, render_notes, run_inspect
    try:
        plan = plan_inspect(args.benchmark or args.workload, _recipe_words(args.recipes), device=args.device,
                            batch_size=args.batch_size)
        if args.json is not None:
            _check_writable(args.json, "--json")
        report = run_inspect(plan)    # traces; a model that cannot be traced is a ValueError saying so
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from e
    if args.json is not None:
        args.json.write_text(report.to_json() + "\n")
        print(f"report written to {args.json}", file=sys.stderr)
    out = stdout_console()
    out.print(render_memory_table(report))
    out.print(render_matmul_table(report))
    for line in render_notes(report):
        out.print(line, soft_wrap=True)
    return 0


def _make_out_dir(path: Path, files: tuple[str, str] = ("report.json", "report.html")) -> None:
    """Create ``--out``'s directory (and its parents) now, so a bad path fails before training."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file; give a directory for {files[0]} and {files[1]}, "
                         f"e.g. --out {path.with_suffix('')}-report")
    _check_no_file_on_the_way(path, "--out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create the directory ({e.strerror}); choose a path in a "
                         "writable directory") from None


def _check_writable(path: Path, option: str, fix: str | None = None) -> None:
    """Fail now, not after training, if ``option``'s file cannot be written to ``path``.

    ``fix`` says what to do when ``path`` is a directory (default: name a file in it).
    """
    if path.is_dir():
        fix = fix or f"give a file path, e.g. {option} {path / 'compare.json'}"
        raise ValueError(f"{option} {path} is a directory; {fix}")
    parent = path.parent
    _check_no_file_on_the_way(parent, option, path)
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: directory {parent} does not exist; create it "
                         f"(mkdir -p {parent}) or choose another path")
    existed = path.exists()
    try:
        # Open for append: proves we may write there without truncating an existing file now.
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path} is not writable ({e.strerror}); choose a path in a writable "
                         "directory") from None
    if not existed:
        os.unlink(path)


def _check_no_file_on_the_way(directory: Path, option: str, path: Path | None = None) -> None:
    """A file where the path needs a directory (``afile`` in ``afile/x.json``): mkdir -p cannot help."""
    for ancestor in (directory, *directory.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ValueError(f"{option} {path or directory}: {ancestor} is a file, not a directory; "
                                 "choose a path whose folders are folders")
            return


if __name__ == "__main__":
    sys.exit(main())

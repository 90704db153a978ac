"""``mixprec trace``: which op ran in which dtype, for one forward and backward of a workload.

    mixprec trace --workload gpt --recipe bf16,fp32_ops=layer_norm,modules=lm_head:fp32
    mixprec trace --workload cnn --recipe fp16-pure --json trace.json

The batch is the workload's first ``--batch-size`` training rows; the model is built from ``--seed``
exactly as ``mixprec compare`` builds it. The table goes to stdout, the JSON (``OpTrace.to_json``) to
``--json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from rich.table import Table

from ..casting import check_module_patterns
from ..devices import resolve_device, supports
from ..diagnostics.optrace import OpTrace, trace_ops
from ..oplists import op_list_mode
from ..recipe import RECIPES, Recipe, get_recipe
from .cli_args import add_device_arg, add_workload_args
from .workloads import get_workload
from .console import stdout_console

__all__ = ["add_trace_parser", "plan_trace", "render_trace"]


def add_trace_parser(commands: argparse._SubParsersAction) -> None:
    """The ``trace`` subcommand's arguments (the CLI checks them with ``plan_trace``)."""
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


def plan_trace(args: argparse.Namespace, check_writable: Callable[[Path, str], None]) -> Callable[[], int]:
    """Check every input (ValueError/TypeError name the fix); returns the run that traces and prints.

    ``check_writable`` is the CLI's own path check, passed in so this module does not import the CLI.
    """
    recipe = get_recipe(args.recipe)
    workload = get_workload(args.benchmark or args.workload)
    device = resolve_device(args.device)
    support = supports(recipe, device)
    if not support.ok:
        runnable = [n for n, r in RECIPES.items() if supports(r, device).ok]
        raise ValueError(f"recipe {recipe.label!r} cannot run on {device}: {support.reason} "
                         f"(recipes {device.type} can run: {', '.join(runnable)})")
    batch = workload.batch_size if args.batch_size is None else args.batch_size
    if isinstance(batch, bool) or batch < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch}")
    if args.json is not None:
        check_writable(args.json, "--json")
    data = workload.load_data()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = workload.build_model()
    model.to(device)
    check_module_patterns(model, recipe)      # before any work: a glob that matches nothing is a typo
    x, y = data.x_train[:batch].to(device), data.y_train[:batch].to(device)
    return functools.partial(_trace_and_print, model, recipe, workload.loss_fn, x, y, args.json)


def _trace_and_print(model, recipe: Recipe, loss_fn, x, y, json_path: Path | None) -> int:
    trace = trace_ops(model, recipe, lambda m: loss_fn(m(x), y))
    if json_path is not None:
        json_path.write_text(trace.to_json() + "\n")
        print(f"trace written to {json_path}", file=sys.stderr)
    out = stdout_console()
    if not out.is_terminal:
        out.width = max(out.width, 112)   # piped: room for aten names such as native_layer_norm_backward
    out.print(render_trace(trace, recipe))
    return 0


def render_trace(trace: OpTrace, recipe: Recipe | None = None) -> Table:
    """The trace as a rich table: a block of rows per module and phase, first-run order."""
    recipe = recipe or get_recipe(trace.recipe)
    table = Table(title=f"one forward and backward under {recipe.label} on {trace.device}",
                  caption=_caption(trace, recipe), caption_justify="left")
    for column, justify in (("module", "left"), ("phase", "left"), ("op", "left"),
                            ("inputs", "left"), ("output", "left"), ("calls", "right")):
        table.add_column(column, justify=justify, no_wrap=column != "op")
    previous = None
    for r in trace.records:
        group = (r.module, r.phase)
        table.add_row((r.module or "(model/loss)") if group != previous else "",
                      r.phase if group != previous else "", r.op, _dtypes(r.inputs), r.output,
                      str(r.count), end_section=False)
        previous = group
    return table


def _dtypes(inputs: tuple[str, ...]) -> str:
    """``("bf16", "bf16", "fp32")`` -> ``"bf16 x2, fp32"``."""
    parts: list[str] = []
    for d in dict.fromkeys(inputs):
        n = inputs.count(d)
        parts.append(d if n == 1 else f"{d} x{n}")
    return ", ".join(parts) or "-"


def _caption(trace: OpTrace, recipe: Recipe) -> str:
    lines = []
    for phase in ("forward", "backward"):
        counts = trace.counts_by_dtype(phase)
        lines.append(f"{phase}: " + ", ".join(f"{n} op calls -> {d}" for d, n in
                                              sorted(counts.items(), key=lambda kv: -kv[1])))
    edits = recipe.op_edits
    if edits:
        device_type = trace.device.split(":")[0]
        active = op_list_mode(edits, device_type)
        applied = sorted(active.edits) if active else []
        same = sorted(set(edits) - set(applied))
        lines.append("op-list edits applied: " + (", ".join(f"{op}->{edits[op].value}" for op in applied)
                                                  or "none")
                     + (f"; already autocast's policy on {device_type}: {', '.join(same)}" if same else ""))
    if recipe.modules:
        lines.append("module precision: " + ", ".join(f"{p}:{prec.value}" for p, prec in recipe.modules))
    return "\n".join(lines)

"""The console view of a trace: a block of rows per module and phase, and a caption of dtype counts
and of the recipe's op-list edits and module regions."""

from __future__ import annotations

from rich.table import Table

from ...diagnostics.optrace import OpTrace
from ...casting.oplists import op_list_mode
from ...recipe import Recipe, get_recipe

__all__ = ["render_trace"]


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

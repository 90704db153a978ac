"""The fp8 part of a doctor report: which linears became fp8, and each one's underflow and saturation.

For an fp8 recipe the doctor turns on exact counting (``count_fp8_ranges``) before it trains and keeps
``fp8_layer_stats`` and the engine's swap report in the ``DoctorReport`` (fields ``fp8_layers`` and
``fp8_swap``; empty/None for other recipes; their JSON is in report.py). This module renders them:
the swap summary lines, the fp8 table and the fp8 findings::

    for line in fp8_swap_lines(report.fp8_swap):   # "fp8: 1 of 2 linear layers swapped, ...", reasons
        print(line)
    console.print(render_fp8_table(report))        # layer, role, format, scale, amax, headroom, %
    render_fp8_findings(report)                    # worst saturation and flush, and what to do

The flushed/saturated percentages are exact counts over every training cast of the run; scale, amax
and headroom are those of the last cast.
"""

from __future__ import annotations

import dataclasses
import math

from rich import box
from rich.table import Table

from ...fp8.stats import Fp8TensorStats
from ...fp8.swap_report import Fp8SwapReport
from .render import percent_text
from .report import DoctorReport
from ...recipe import RECIPES, Fp8Config, get_recipe

__all__ = ["fp8_swap_lines", "fp8_rows", "render_fp8_table", "render_fp8_findings", "suggest"]


# ----------------------------------------------------------------------------------- text
def fp8_swap_lines(swap: Fp8SwapReport | None) -> list[str]:
    """One summary line, then one line per linear layer that stayed out of fp8 and why, then one per
    weight outside linear layers (embeddings, convolutions, a mixture of experts' expert weights)."""
    if swap is None:
        return []
    share = f", {swap.fp8_fraction:.0%} of the parameters" if swap.parameters else ""
    lines = [f"fp8: {len(swap.swapped)} of {len(swap.layers)} {swap.kinds} swapped "
             f"({', '.join(repr(n) for n in swap.swapped) or 'none'}{share}), backend {swap.backend}"]
    if swap.note:
        lines.append(f"  {swap.note}")       # how the backend was chosen
    for d in swap.layers:
        if not d.swapped:
            lines.append(f"  not fp8: {d.name!r} ({d.out_features}, {d.in_features}): {d.reason.value}"
                         + (f": {d.detail}" if d.detail else ""))
    for u in swap.uncovered:
        lines.append(f"  not fp8: {u.name!r} {u.shape}: {u.reason}")
    return lines


def fp8_rows(report: DoctorReport) -> list[tuple[str, Fp8TensorStats]]:
    """(layer name, tensor stats) for every fp8 layer and role, in model order."""
    return [(layer.name, t) for layer in report.fp8_layers for t in layer.tensors]


def render_fp8_table(report: DoctorReport) -> Table:
    """Per fp8 layer and tensor: format, last scale and amax, headroom bits, flushed and saturated %."""
    table = Table(title=f"fp8 tensors: last scale and amax; flushed/saturated over all {report.steps} "
                        "steps' casts", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for header in ("layer", "tensor", "format", "scale", "amax", "headroom", "flushed", "saturated"):
        table.add_column(header, justify="left" if header in ("layer", "tensor", "format") else "right",
                         no_wrap=True)
    for name, t in fp8_rows(report):
        table.add_row(name, t.role, t.format.removeprefix("fp8_"), f"{t.scale:.3g}", f"{t.amax:.3g}",
                      _bits(t.headroom_bits), percent_text(t.flushed_fraction), percent_text(t.saturated_fraction))
    return table


def _bits(h: float) -> str:
    return f"{h:+.2f} b" if math.isfinite(h) else str(h)     # -0.00: a hair below the max


def render_fp8_findings(report: DoctorReport) -> list[str]:
    """Where fp8 clipped or flushed most, and what to try; one line when neither happened."""
    rows = [(n, t) for n, t in fp8_rows(report) if t.counted]
    if not rows:
        return []
    delayed = any(t.history_amax is not None for _, t in rows)
    out = []
    sat = max(rows, key=lambda r: r[1].saturated_fraction or 0.0)
    if sat[1].saturated_fraction:
        n, t = sat
        if delayed:
            fix = ("delayed scaling took the scale from earlier amaxes and this tensor outgrew them: give "
                   f"it a margin ({suggest(report, margin=1)}), a longer history "
                   f"({suggest(report, history=32)}), or current scaling (--recipe fp8), or keep the layer "
                   f"out of fp8 ({suggest(report, skip=n)})")
        else:
            # Current scaling maps this cast's own amax to F.max, so saturation means a margin < 0 or
            # a NaN/inf amax; values that round down to F.max are not counted (fp8/linear.py).
            fix = (f"add a margin ({suggest(report, margin=1, delayed=False)}) or keep the layer out of "
                   f"fp8 ({suggest(report, skip=n, delayed=False)})")
        out.append(f"fp8 saturation: layer {n!r}, {percent_text(t.saturated_fraction)} of its {t.role} values "
                   f"exceeded {t.format}'s max (last headroom {_bits(t.headroom_bits)}); {fix}")
    flush = max(rows, key=lambda r: r[1].flushed_fraction or 0.0)
    if flush[1].flushed_fraction:
        n, t = flush
        fix = (f"a stale large amax in the history lowers the scale: try {suggest(report, amax='recent')} "
               "or current scaling (--recipe fp8)"
               if delayed and t.history_amax is not None and t.history_amax > t.amax else
               "the scale already puts its amax near the format's max, so these values lie more than "
               "the format's range below it" + ("; a margin would flush more" if not delayed else ""))
        out.append(f"fp8 underflow: layer {n!r}, {percent_text(t.flushed_fraction)} of its {t.role} values "
                   f"flushed to zero in {t.format} (|x| <= {t.flush_below:.3g} at the last scale); {fix}; "
                   f"if that loses accuracy, keep the layer out of fp8 "
                   f"({suggest(report, skip=n, delayed=delayed)})")
    if not out:
        low = min(rows, key=lambda r: r[1].headroom_bits)
        out.append(f"fp8: no value of the {len(report.fp8_layers)} fp8 layer(s) flushed or saturated over "
                   f"{report.steps} steps (least headroom: {low[0]!r} {low[1].role}, "
                   f"{_bits(low[1].headroom_bits)})")
    return out


def suggest(report: DoctorReport, *, delayed: bool | None = None, **changes: object) -> str:
    """``--recipe '...'``: the report's recipe with its fp8 options changed, spelled so it parses back.

    A bare ``fp8=delayed(margin=1)`` would parse as fp32 compute with fp8 (the named recipes run bf16
    around their fp8 layers), so the advice keeps everything else of the recipe that ran: the named
    recipe it came from plus the edited ``fp8=``, or the full string.
    """
    recipe = get_recipe(report.recipe)
    fp8 = recipe.fp8 or Fp8Config()
    if delayed is not None and delayed != fp8.delayed:   # the other scaling: its own defaults
        fp8 = dataclasses.replace(Fp8Config.parse("delayed" if delayed else "current"), margin=fp8.margin,
                                  pow2=fp8.pow2, skip=fp8.skip, force=fp8.force, backend=fp8.backend)
    if "skip" in changes:
        changes["skip"] = tuple(dict.fromkeys((*fp8.skip, changes["skip"])))
    edited = dataclasses.replace(recipe, fp8=dataclasses.replace(fp8, **changes))
    # Shortest spelling: a named recipe (one with the same scaling first) and its new fp8.
    named = sorted(RECIPES.items(), key=lambda kv: kv[1].fp8 is None or kv[1].fp8.delayed != fp8.delayed)
    for name, base in named:
        if base.fp8 is not None and dataclasses.replace(base, fp8=edited.fp8) == edited:
            return f"--recipe '{name},fp8={edited.fp8}'"
    return f"--recipe '{edited}'"

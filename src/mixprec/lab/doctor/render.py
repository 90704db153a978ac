"""The console view of a DoctorReport: the per-layer table (worst first) and the findings in plain sentences.

    console.print(render_doctor_table(report))
    for line in render_findings(report):
        print("-", line)
"""

from __future__ import annotations

import dataclasses
import math

from rich import box
from rich.table import Table

from ...diagnostics.range_histogram import TensorStats
from ...diagnostics.scale_window import ScaleWindow, below_floor
from ...recipe import Precision, get_recipe
from .report import DoctorReport

__all__ = ["LayerRow", "layer_rows", "render_doctor_table", "render_findings", "pow2_text", "percent_text"]


def pow2_text(k: int | None) -> str:
    return "-" if k is None else f"2^{k}"


def percent_text(fraction: float | None) -> str:
    """A fraction as a percentage with enough digits to tell 0 from tiny."""
    if fraction is None:
        return "-"
    if fraction == 0:
        return "0"
    pct = 100 * fraction
    return f"{pct:.1f}%" if pct >= 0.1 else f"{pct:.2g}%"


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One module's line in the doctor table (fractions; None where the module has no such tensors)."""

    name: str
    type: str
    underflow: float | None      # nonzero gradients below 2**-24 with no loss scale
    underflow_run: float | None  # ... at the run's final loss scale
    overflow: float | None       # activations that are, or would become, inf in fp16
    act_amax: float | None
    grad_amax: float | None
    lost_fp16: float | None      # nonzero updates lost on fp16 weights
    lost_bf16: float | None
    window: ScaleWindow

    @property
    def severity(self) -> float:
        return max(self.underflow or 0.0, self.overflow or 0.0, self.lost_fp16 or 0.0)


def layer_rows(report: DoctorReport) -> list[LayerRow]:
    """One row per module, worst first (the largest of its underflow, overflow and update loss)."""
    k_run = _exp_of(report.final_scale)
    rows = []
    for m in report.modules:
        grads, acts = m.gradients(), m.stats.get("activations")
        overflow = None
        if acts is not None and acts.count:
            fp16 = acts.formats["fp16"]
            overflow = (fp16.overflow + fp16.nonfinite) / acts.count
        rows.append(LayerRow(
            name=m.name, type=m.type,
            underflow=below_floor(grads, 0) if grads else None,
            underflow_run=below_floor(grads, k_run) if grads and k_run is not None else None,
            overflow=overflow, act_amax=acts.amax if acts else None, grad_amax=grads.amax if grads else None,
            lost_fp16=m.update_loss.fraction("fp16") if m.update_loss else None,
            lost_bf16=m.update_loss.fraction("bf16") if m.update_loss else None,
            window=report.module_window(m)))
    return sorted(rows, key=lambda r: -r.severity)   # stable: ties keep model order


def _exp_of(scale: float) -> int | None:
    """log2 of a power-of-two scale, None for any other (the bins only shift by whole powers)."""
    if scale > 0 and math.isfinite(scale):
        k = math.log2(scale)
        if k.is_integer():
            return int(k)
    return None


def render_doctor_table(report: DoctorReport) -> Table:
    """The per-layer table: worst first, fractions as percentages, scales as powers of two."""
    table = Table(title=f"{report.workload} under {report.label} on {report.device}: ranges over "
                        f"{report.steps} steps (gradients in true units)",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    k_run = _exp_of(report.final_scale)
    run_scale = pow2_text(k_run) if k_run is not None else f"{report.final_scale:g}"
    # Narrow headers, no type column: the table fits an 80-column log for short module names.
    for header in ("module", "grad<2^-24", f"@{run_scale}", "act ovf", "grad max", "lost fp16", "bf16",
                   "window", "rec"):
        table.add_column(header, justify="left" if header == "module" else "right", no_wrap=True)
    for r in layer_rows(report):
        w = r.window
        table.add_row(r.name or "(model)", percent_text(r.underflow), percent_text(r.underflow_run),
                      percent_text(r.overflow), _num(r.grad_amax), percent_text(r.lost_fp16),
                      percent_text(r.lost_bf16), f"{w.low}..{w.high}" if w.low is not None else "-",
                      pow2_text(w.recommended))
    return table


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def render_findings(report: DoctorReport) -> list[str]:
    """A few plain sentences: what underflows, the scale to use, lost updates, overflows."""
    rows = layer_rows(report)
    w = report.window
    out = []
    worst = max((r for r in rows if r.underflow is not None), key=lambda r: r.underflow, default=None)
    out.append(f"gradients: {percent_text(w.below_floor_unscaled)} of the nonzero gradient values lie "
               f"below fp16's smallest subnormal (2^-24) in true units; without loss scaling fp16 flushes "
               f"them to zero or rounds them to 2^-24"
               + (f" (worst: module {worst.name!r}, {percent_text(worst.underflow)})" if worst and worst.underflow
                  else ""))
    # Only fp16 compute flushes small gradients to zero in the backward (bf16/fp8 recipes keep fp32's range).
    fp16_unscaled = not report.scaled and get_recipe(report.recipe).compute is Precision.FP16
    dead = [m.name for m in report.modules
            if (g := m.gradients()) is not None and g.count and g.zeros == g.count]
    if dead:
        out.append(f"every gradient value of module{'s' if len(dead) > 1 else ''} "
                   f"{', '.join(repr(n) for n in dead)} was exactly zero"
                   + (": without a loss scale, that is what fp16's flush looks like" if fp16_unscaled else ""))
    if w.low is None:
        out.append("loss scale: no nonzero finite gradients were seen; nothing to recommend")
    elif w.fits:
        out.append(f"loss scale: powers of two from {pow2_text(w.low)} to {pow2_text(w.high)} keep all but "
                   f"{percent_text(report.small_fraction)} of the gradients at or above 2^-24 and the "
                   f"largest ({w.amax:.3g}) {report.margin:g}x below fp16's max; recommended "
                   f"{pow2_text(w.recommended)}")
    else:
        out.append(f"loss scale: no power of two fits: lifting the small gradients needs "
                   f"{pow2_text(w.low)} but the largest ({w.amax:.3g}) allows at most {pow2_text(w.high)}: "
                   "the gradients span more than fp16's range; use bf16 (fp32's exponent range)")
    k_run = _exp_of(report.final_scale)
    if report.scaled and w.low is not None:
        where = ("inside the window" if k_run is not None and w.fits and w.low <= k_run <= w.high
                 else "above the window (overflow risk: it skips steps and backs off)"
                 if k_run is not None and k_run > w.high
                 else "below the window (small gradients still flush)")
        share = below_floor(_all_grads(report), k_run) if k_run is not None else None
        at_run = "" if share is None else \
            f"; at that scale {percent_text(share) if share else 'none'} of the gradients stay below 2^-24"
        out.append(f"the run's loss scaler ended at {report.final_scale:g} after {report.steps} steps "
                   f"({report.skipped_steps} skipped): {where}{at_run}")
    elif fp16_unscaled:
        out.append("this recipe does not scale the loss: gradients that fp16 flushed during backward were "
                   "counted as zeros, not as small values; run the doctor with scale=dynamic (the default "
                   "fp16 recipe) or fp32 to see their true sizes")
    lost = [r for r in rows if r.lost_fp16]
    if lost:
        top = max(lost, key=lambda r: r.lost_fp16)
        bf16 = max((r.lost_bf16 or 0.0) for r in rows)
        out.append(f"updates: on fp16 weights up to {percent_text(top.lost_fp16)} of a layer's nonzero "
                   f"updates would round away (module {top.name!r}); on bf16 weights up to {percent_text(bf16)}: "
                   "keep fp32 master weights (fp16-pure, bf16-pure) or stochastic rounding (bf16-sr)")
    over = [r for r in rows if r.overflow]
    if over:
        top = max(over, key=lambda r: r.overflow)
        out.append(f"overflow: {percent_text(top.overflow)} of module {top.name!r}'s activations exceed fp16's max "
                   "(65504); keep that module in fp32 or use bf16")
    return out


def _all_grads(report: DoctorReport) -> TensorStats:
    merged = TensorStats.merge([g for g in (m.gradients() for m in report.modules) if g is not None])
    assert merged is not None
    return merged

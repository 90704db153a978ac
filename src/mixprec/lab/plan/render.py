"""The console view of a plan: a row per layer (format, evidence, share of FLOPs, why), then the
prediction, the verification and the recipe."""

from __future__ import annotations

import math

from rich.table import Table

from ...recipe import get_recipe
from .report import PlanReport

__all__ = ["render_plan", "plan_lines", "weight_cell"]


def _db(x: float) -> str:
    return "inf" if x == math.inf else "-" if not math.isfinite(x) else f"{x:.1f}"


def weight_cell(lay) -> str:
    """(out, in); an experts module's as experts x (out, in) of its first projection."""
    return (f"{lay.groups} x " if lay.groups > 1 else "") + f"({lay.out_features}, {lay.in_features})"


def render_plan(report: PlanReport) -> Table:
    """The plan as a rich table, with the prediction and verification in its caption."""
    table = Table(title=f"mixprec plan: {report.workload} for {report.target_label} (SQNR floor "
                        f"{report.floor_db:g} dB)", caption="\n".join(plan_lines(report)), caption_justify="left")
    for column, justify in (("layer", "left"), ("weight (out, in)", "right"), ("rows", "right"),
                            ("FLOPs", "right"), ("format", "left"), ("SQNR dB / grad SNR", "left"),
                            ("time vs bf16", "right"), ("why", "left")):
        table.add_column(column, justify=justify, no_wrap=column not in ("why", "SQNR dB / grad SNR"))
    for lay in report.layers:
        evidence = " ".join(f"{f}:{_db(e.sqnr_db)}/{_db(e.grad_snr)}{'' if e.passes else '✗'}"
                            for f, e in lay.evidence.items())
        table.add_row(lay.name, weight_cell(lay), str(lay.rows),
                      f"{lay.flops_share:.0%}", lay.format, evidence or "-",
                      f"{lay.plan_s / lay.bf16_s:.2f}x" if lay.bf16_s else "-", lay.why)
    return table


def plan_lines(report: PlanReport) -> list[str]:
    """The lines under the table: prediction (for the target, not measured here), band, verification."""
    band = report.band
    lines = [
        "evidence per format: the what-if's one-step SQNR (dB, floor "
        f"{report.floor_db:g}) / the end-to-end weight-gradient SNR against fp32 (floor sqrt(3)); ✗: fails",
        f"predicted on {report.target} (spec-sheet roofline, not measured on this {report.device}): step time "
        f"{report.step_ratio:.3f}x bf16's (the planned linears {report.linear_ratio:.3f}x; bf16 step "
        f"{report.bf16_step_s * 1e3:.3f} ms there)",
        f"activations saved on step 0, measured here: bf16 {report.saved_bytes_bf16 / 2**20:.1f} MiB, plan "
        f"{report.saved_bytes_plan / 2**20:.1f} MiB",
        f"band: fp32 from seeds {report.seed} and {report.seed + 1} ended {band.spread:.4f} nats apart over "
        f"{report.steps} steps (floor {band.floor:.4f}); budget {report.budget:g}x -> {band.band:.4f} nats",
    ]
    if report.not_planned:
        lines.append(f"not planned, kept bf16 by skip=: {', '.join(report.not_planned)} (grouped expert GEMMs: "
                     "the counted forward never called them)")
    bf16 = str(get_recipe("bf16"))
    for i, a in enumerate(report.attempts, 1):
        verdict = "inside" if a.inside else "OUTSIDE"
        raised = f" after raising {', '.join(a.raised)}" if a.raised else ""
        if a.recipe == bf16:          # every layer bf16: the reference itself, not trained again
            lines.append(f"try {i}{raised}: every layer bf16, the reference itself (nothing to verify)")
        else:
            lines.append(f"verification {i}{raised}: tail {a.gap:+.4f} nats against bf16, {verdict} the band")
    if report.contrast is not None:
        c = report.contrast
        lines.append(f"contrast, {c.format} on every planned layer that takes it: tail {c.gap:+.4f} nats against "
                     f"bf16, {'inside' if c.inside else 'OUTSIDE'} the band ({c.recipe})")
    if report.accepted:
        lines.append(f"recipe (trains as verified: same seed, same losses): {report.recipe}")
    else:
        lines.append("no recipe met the budget; still low-precision at the last try: " + "; ".join(report.failing))
    lines.append(f"planned in {report.seconds:.0f} s here")
    return lines

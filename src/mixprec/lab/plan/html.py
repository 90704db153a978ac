"""The plan as a self-contained HTML page: the table, and the loss curves it was verified on (fp32 from
two seeds, bf16, and each verification attempt, lockstep from one init)."""

from __future__ import annotations

import base64
import io
from html import escape

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .render import plan_lines, weight_cell
from .report import PlanReport

__all__ = ["render_plan_html"]


def render_plan_html(report: PlanReport) -> str:
    """The page: title, prediction and verification lines, the per-layer table, the curves (inline PNG)."""
    head = ("layer", "weight (out, in)", "rows", "FLOPs", "format", "SQNR dB / grad SNR", "time vs bf16", "why")
    rows = []
    for lay in report.layers:
        evidence = ", ".join(f"{f} {e.sqnr_db:.1f} dB / {e.grad_snr:.1f}{'' if e.passes else ' (fails)'}"
                             for f, e in lay.evidence.items())
        cells = (lay.name, weight_cell(lay), lay.rows, f"{lay.flops_share:.0%}",
                 lay.format, evidence or "-", f"{lay.plan_s / lay.bf16_s:.2f}x" if lay.bf16_s else "-", lay.why)
        rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    table = ("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
             + "".join(rows) + "</tbody></table>")
    lines = "".join(f"<li>{escape(line)}</li>" for line in plan_lines(report))
    title = f"mixprec plan: {report.workload} for {report.target_label}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ddd;padding:4px 8px;font-size:90%}</style></head><body>"
            f"<h1>{escape(title)}</h1><ul>{lines}</ul>{table}"
            f"<figure><img alt='loss curves' src='data:image/png;base64,{_curves(report)}'>"
            "<figcaption>Train loss per step, lockstep from one init and one batch order (fp32 seed "
            f"{report.seed + 1}: other weights and batches, the band's second run)</figcaption></figure>"
            "</body></html>")


def _curves(report: PlanReport) -> str:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)                 # Agg, attached to this figure only: no global backend state
    ax = fig.add_subplot()
    ax.plot(report.band.losses_a, color="#777777", label=f"fp32 seed {report.seed}")
    ax.plot(report.band.losses_b, color="#bbbbbb", label=f"fp32 seed {report.seed + 1}")
    ax.plot(report.bf16_losses, color="#1f77b4", label="bf16")
    for i, a in enumerate(report.attempts, 1):
        ax.plot(a.losses, linestyle="--", label=f"plan try {i} ({'inside' if a.inside else 'outside'})")
    if report.contrast is not None:
        ax.plot(report.contrast.losses, linestyle=":", color="#d62728",
                label=f"contrast ({'inside' if report.contrast.inside else 'outside'})")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")

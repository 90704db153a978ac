"""The HTML page of a DoctorReport: findings, the layer table, fp8 tensors, histograms, per-format tables.

One self-contained file (inline CSS and base64 PNGs, as compare's page), rendered from the typed report
alone. fp8 runs add a section after the layer table: the swap decisions and, per fp8 layer and
tensor, scale, amax, headroom and the exact flushed and saturated shares. Each histogram puts ``floor(log2|x|)`` on the x axis and the share of nonzero values on the y
axis, over fp16's range: red where fp16 flushes to zero (below ``2**-24``), amber where it is subnormal
(``2**-24 .. 2**-14``), white where it is normal, red again above its max (65504). Gradient panels also
draw the histogram shifted by the recommended loss scale (a whole number of bins: ``2**k`` moves every
exponent by ``k``) and by the scale the run ended with.

    page = render_doctor_html(DoctorReport.from_json(Path("doctor.json").read_text()))
"""

from __future__ import annotations

from html import escape

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from rich.table import Table

from ...diagnostics.range_histogram import RANGE_FORMATS, TensorStats
from ...diagnostics.range_collector import KINDS
from .render_fp8 import fp8_rows, fp8_swap_lines, render_fp8_findings, render_fp8_table
from .render_what_if import what_if_section
from .render import _exp_of, percent_text, pow2_text, render_doctor_table, render_findings
from .report import DoctorReport
from ..compare.html import _FULL, _figure, _new_figure, _style, _text
from ..page import page_html, rich_table_html

__all__ = ["render_doctor_html"]

_FLUSH, _SUBNORMAL = -24, -14       # log2 of fp16's smallest subnormal and smallest normal
_MAX_BIN = 15                       # 65504 = 1.999 * 2**15: the last fp16 binade
_RED, _AMBER = "#f4c7c3", "#fde9c4"
_BARS, _SHIFT, _RUN = "#4c72b0", "#2ca02c", "#9467bd"


def render_doctor_html(report: DoctorReport) -> str:
    """The report as one self-contained HTML page (no network needed to view it)."""
    title = f"mixprec doctor: {report.workload} under {report.label} on {report.device}"
    k_run = _exp_of(report.final_scale) if report.scaled else None
    meta = [("workload", report.workload), ("recipe", report.recipe),
            ("device", f"{report.device} ({report.device_name})"),
            ("steps x batch", f"{report.steps} x {report.batch_size}"), ("seed", str(report.seed)),
            ("final loss scale", f"{report.final_scale:g}" if report.scaled else "none"),
            ("skipped", str(report.skipped_steps)), ("torch", report.torch_version),
            ("mixprec", report.mixprec_version)]
    fp8 = report.fp8_swap is not None
    # An fp8 run leads with what its fp8 casts did; the fp16 lines then say what fp16 would do.
    lines = (render_fp8_findings(report) + render_findings(report) if fp8
             else render_findings(report) + render_fp8_findings(report))
    findings = "".join(f"<li>{escape(n)}</li>" for n in lines)
    grads = TensorStats.merge([g for g in (m.gradients() for m in report.modules) if g is not None])
    # The shifted outlines show a loss scale's effect on fp16: fp8 casts scale each tensor themselves.
    shift = None if fp8 else report.window.recommended
    k_shown = None if fp8 else k_run
    bands = ("Red bands: fp16's range, for reference (fp16 would flush below it or overflow above it); "
             "amber: fp16 subnormals. This run's fp8 casts scale each tensor: the fp8 plot above shows "
             "what they flushed and saturated." if fp8 else
             "Red bands: fp16 flushes to zero or overflows; amber: fp16 subnormals (fewer mantissa bits).")
    overview = _figure("plot-gradients", _overview(grads, shift, k_shown),
                       "All gradients of the run (activation and weight gradients of every module, true "
                       "units): the share of nonzero values in each binade. Bars: as computed"
                       + ("; green outline: multiplied by the recommended loss scale" if shift is not None else "")
                       + ("; purple dashes: by the scale the run ended with" if k_shown not in (None, shift) else "")
                       + ". " + bands)
    layers = []
    for m in report.modules:
        w = report.module_window(m)
        fig = _layer_figure(m.stats.get("activations"), m.gradients(), shift, k_shown)
        caption = (f"{m.name} ({m.type}): activations (left) and gradients (right, true units); its own "
                   f"fp16 scale window {pow2_text(w.low)}..{pow2_text(w.high)}, recommended "
                   f"{pow2_text(w.recommended)}.")
        layers.append(_figure(f"plot-{m.name or 'model'}", fig, caption))
    index = ('<nav class="index" id="layer-index">Jump to a layer: '
             + " ".join(f'<a href="#plot-{escape(m.name or "model")}">{escape(m.name or "model")}</a>'
                        for m in report.modules) + "</nav>")
    sections = [("findings", "findings"), ("layer-table", "layer table")] + (
        [("fp8", "fp8")] if fp8 else []) + ([("what-if", "what-if")] if report.what_if else []) + [
            ("plot-gradients", "all gradients"), ("per-layer", "per layer"), ("per-format", "per format")]
    top = ('<nav class="top">' + " ".join(f'<a href="#{i}">{escape(t)}</a>' for i, t in sections) + "</nav>")
    parts = [top, f'<ul class="notes" id="findings">{findings}</ul>', _layer_table(report), _fp8_section(report),
             what_if_section(report), overview, '<h2 id="per-layer">Per layer</h2>', index, *layers,
             '<h2 id="per-format">Per layer and format</h2>', _format_table(report)]
    return page_html(title, meta, parts, extra_css=_EXTRA_CSS)


_EXTRA_CSS = """
h2 { font-size: 18px; margin: 28px 0 10px; }
nav.top { position: sticky; top: 0; z-index: 1; background: #fff; padding: 6px 0; margin: 0 0 10px;
          border-bottom: 1px solid #e3e3e3; font-size: 13.5px; }
nav a { margin-right: 12px; color: #1f5fa8; text-decoration: none; } nav a:hover { text-decoration: underline; }
nav.index { font-size: 13px; line-height: 1.9; margin: 0 0 16px; }
figure, h2 { scroll-margin-top: 40px; }
table.formats td, table.formats th { padding: 3px 8px; font-size: 13px; }
table.formats tr.first td { border-top: 1px solid #999; }
""".strip()


def _fp8_section(report: DoctorReport) -> str:
    """fp8 runs: the swap decisions and, per fp8 layer and tensor, scale, amax, headroom, flushed, saturated."""
    if report.fp8_swap is None:
        return ""
    first, *reasons = fp8_swap_lines(report.fp8_swap)
    notes = "".join(f"<li>{escape(r.strip())}</li>" for r in reasons)
    caption = ("headroom: log2(max / (amax * scale)) at the last cast, negative when it saturated; flushed "
               "and saturated: exact shares of every value cast in training, all steps.")
    plot = _figure("plot-fp8", _fp8_plot(report),
                   "Per fp8 layer and tensor, the exact share of the values cast in training that fp8 flushed "
                   "to zero (red) and saturated at its max (amber), log axis; 0 where none did.")
    return ('<h2 id="fp8">fp8</h2>' + f"<p>{escape(first)}</p>" + (f'<ul class="notes">{notes}</ul>' if notes else "")
            + rich_table_html(render_fp8_table(report), caption) + plot)


def _fp8_plot(report: DoctorReport) -> Figure | str:
    rows = [(f"{name} {t.role} ({t.format.removeprefix('fp8_')})", t) for name, t in fp8_rows(report) if t.counted]
    if not rows:
        return "no fp8 cast was counted in this run"
    fig = _new_figure(_FULL, 0.9 + 0.42 * len(rows))
    ax = _style(fig.add_subplot())
    y = np.arange(len(rows))[::-1]
    floor = 1e-7      # a share below one in ten million draws as the axis' left edge
    for offset, attr, color, label in ((0.2, "flushed_fraction", "#d62728", "flushed"),
                                       (-0.2, "saturated_fraction", "#f0b400", "saturated")):
        values = np.array([getattr(t, attr) or 0.0 for _, t in rows])
        ax.barh(y + offset, np.maximum(values, floor), height=0.38, color=color, label=label, left=0)
        for yi, v in zip(y + offset, values):
            ax.text(max(v, floor) * 1.3, yi, percent_text(v), va="center", fontsize=8, color="#333")
    ax.set_xscale("log")
    ax.set_xlim(floor, 1.0)
    ax.set_yticks(y, [_text(label) for label, _ in rows])
    ax.set_xlabel("share of the values cast")
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=8, frameon=False)
    return fig


def _layer_table(report: DoctorReport) -> str:
    caption = ("grad&lt;2^-24: nonzero gradients below fp16's smallest "
               "subnormal with no loss scale, then at the run's scale; act ovf: activations beyond "
               "fp16's max; lost: nonzero updates that round away on fp16/bf16 weights; worst first.")
    return rich_table_html(render_doctor_table(report), caption, table_id="layer-table")


def _format_table(report: DoctorReport) -> str:
    """Every module and kind: count, zeros, amax, and flush / subnormal / overflow in each format."""
    head = ["module", "kind", "values", "zeros", "amax"] + [f.name for f in RANGE_FORMATS]
    rows = []
    for m in report.modules:
        first = True
        for kind in KINDS:
            s = m.stats.get(kind)
            if s is None:
                continue
            cells = [m.name if first else "", kind, f"{s.count:,}",
                     percent_text(s.zeros / s.count if s.count else 0.0), f"{s.amax:.3g}"]
            cells += [" / ".join(percent_text(s.fraction(f.name, b)) for b in ("flush", "subnormal", "overflow"))
                      for f in RANGE_FORMATS]
            cls = ' class="first"' if first else ""
            rows.append(f"<tr{cls}>" + "".join(f'<td class="{"left" if i < 2 else "right"}">{escape(c)}</td>'
                                               for i, c in enumerate(cells)) + "</tr>")
            first = False
    ths = "".join(f'<th class="{"left" if i < 2 else "right"}">{escape(h)}</th>' for i, h in enumerate(head))
    return (f'<table class="formats"><caption>Exact shares of all values (zeros included) that each format '
            "would flush to zero / make subnormal / overflow; gradients in true units (no loss scale)."
            f"</caption><thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


# ----------------------------------------------------------------------------------- the plots
def _shares(stats: TensorStats) -> tuple[np.ndarray, np.ndarray]:
    """Bins and each bin's share of the nonzero finite values."""
    ks = np.array([k for k, _ in stats.exponents], dtype=float)
    ns = np.array([n for _, n in stats.exponents], dtype=float)
    return ks, ns / max(ns.sum(), 1.0)


def _fp16_bands(ax: Axes, lo: float, hi: float) -> None:
    ax.axvspan(lo, _FLUSH - 0.5, color=_RED, zorder=0, linewidth=0)
    ax.axvspan(_FLUSH - 0.5, _SUBNORMAL - 0.5, color=_AMBER, zorder=0, linewidth=0)
    ax.axvspan(_MAX_BIN + 0.5, hi, color=_RED, zorder=0, linewidth=0)
    for x in (_FLUSH - 0.5, _SUBNORMAL - 0.5, _MAX_BIN + 0.5):
        ax.axvline(x, color="#888", linewidth=0.8, zorder=1)


def _histogram(ax: Axes, stats: TensorStats | None, what: str, shift: int | None = None,
               run_shift: int | None = None) -> None:
    _style(ax)
    if stats is None or not stats.exponents:
        ax.text(0.5, 0.5, f"no nonzero {what}", ha="center", va="center", transform=ax.transAxes,
                color="#666")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    ks, share = _shares(stats)
    shifts = [s for s in (shift, run_shift) if s is not None]
    lo = min([ks.min()] + [ks.min() + s for s in shifts] + [_FLUSH]) - 2
    hi = max([ks.max()] + [ks.max() + s for s in shifts] + [_MAX_BIN]) + 2
    _fp16_bands(ax, lo, hi)
    ax.bar(ks, share, width=0.9, color=_BARS, zorder=2, label=what)
    if run_shift is not None and run_shift != shift:
        ax.step(ks + run_shift, share, where="mid", color=_RUN, linestyle="--", linewidth=1.3, zorder=3,
                label=_text(f"x {pow2_text(run_shift)} (run)"))
    if shift is not None:
        ax.step(ks + shift, share, where="mid", color=_SHIFT, linewidth=1.6, zorder=4,
                label=_text(f"x {pow2_text(shift)} (recommended)"))
    ax.set_xlim(lo, hi)
    ax.set_xlabel("floor(log2 |x|)")
    ax.set_ylabel("share of nonzero values")
    # Above the axes, never over the bars (a "best" legend covered them on narrow histograms).
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=8, frameon=False,
              borderaxespad=0.2)


def _overview(grads: TensorStats | None, shift: int | None, run_shift: int | None) -> Figure:
    fig = _new_figure(_FULL, 3.4)
    _histogram(fig.add_subplot(), grads, "gradients", shift, run_shift)
    return fig


def _layer_figure(acts: TensorStats | None, grads: TensorStats | None, shift: int | None,
                  run_shift: int | None) -> Figure:
    fig = _new_figure(_FULL, 2.5)
    left, right = fig.subplots(1, 2)
    _histogram(left, acts, "activations")
    _histogram(right, grads, "gradients", shift, run_shift)
    return fig

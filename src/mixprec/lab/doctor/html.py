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
from .render_fp8 import fp8_swap_lines, render_fp8_findings, render_fp8_table
from .render import _exp_of, percent_text, pow2_text, render_doctor_table, render_findings
from .report import DoctorReport
from ..compare.html import _CSS, _FULL, _figure, _new_figure, _style, _text

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
    findings = "".join(f"<li>{escape(n)}</li>" for n in render_findings(report) + render_fp8_findings(report))
    grads = TensorStats.merge([g for g in (m.gradients() for m in report.modules) if g is not None])
    overview = _figure("plot-gradients", _overview(grads, report.window.recommended, k_run),
                       "All gradients of the run (activation and weight gradients of every module, true "
                       "units): the share of nonzero values in each binade. Bars: as computed; green "
                       "outline: multiplied by the recommended loss scale; purple dashes: by the scale "
                       "the run ended with. Red bands: fp16 flushes to zero or overflows; amber: fp16 "
                       "subnormals (fewer mantissa bits).")
    layers = []
    for m in report.modules:
        w = report.module_window(m)
        fig = _layer_figure(m.stats.get("activations"), m.gradients(), report.window.recommended, k_run)
        caption = (f"{m.name} ({m.type}): activations (left) and gradients (right, true units); its own "
                   f"scale window {pow2_text(w.low)}..{pow2_text(w.high)}, recommended "
                   f"{pow2_text(w.recommended)}.")
        layers.append(_figure(f"plot-{m.name or 'model'}", fig, caption))
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title>", f"<style>{_CSS}\n{_EXTRA_CSS}</style>", "</head>", "<body>",
        "<main>", f"<h1>{escape(title)}</h1>",
        '<dl class="meta">' + "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>"
                                      for k, v in meta) + "</dl>",
        f'<ul class="notes">{findings}</ul>', _layer_table(report), _fp8_section(report), overview,
        "<h2>Per layer</h2>", *layers, "<h2>Per layer and format</h2>", _format_table(report),
        "</main>", "</body>", "</html>", ""])


_EXTRA_CSS = """
h2 { font-size: 18px; margin: 28px 0 10px; }
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
    return ("<h2>fp8</h2>" + f"<p>{escape(first)}</p>" + (f'<ul class="notes">{notes}</ul>' if notes else "")
            + _rich_table_html(render_fp8_table(report), caption))


def _layer_table(report: DoctorReport) -> str:
    caption = ("grad&lt;2^-24: nonzero gradients below fp16's smallest "
               "subnormal with no loss scale, then at the run's scale; act ovf: activations beyond "
               "fp16's max; lost: nonzero updates that round away on fp16/bf16 weights; worst first.")
    return _rich_table_html(render_doctor_table(report), caption)


def _rich_table_html(table: Table, caption: str) -> str:
    """A rich Table's title, headers and cells as an HTML table; ``caption`` is HTML, added after the title."""
    cols = table.columns
    head = "".join(f'<th class="{c.justify}">{escape(str(c.header))}</th>' for c in cols)
    cells = [list(c.cells) for c in cols]
    rows = "".join("<tr>" + "".join(f'<td class="{c.justify}">{escape(str(cells[j][i]))}</td>'
                                    for j, c in enumerate(cols)) + "</tr>" for i in range(table.row_count))
    return (f"<table><caption>{escape(str(table.title))}. {caption}</caption><thead><tr>{head}</tr></thead><tbody>{rows}</tbody>"
            "</table>")


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
    ax.legend(loc="best", fontsize=8, framealpha=0.9)


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

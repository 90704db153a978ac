"""The HTML page of an InspectReport: memory by role per recipe (table and stacked bars), the matmul
table with what misses the tensor cores, the padding that fixes it, and the notes.

One self-contained file like compare's and doctor's pages (``lab/page.py``), rendered from the typed
report alone, so ``InspectReport.from_json`` of the written JSON gives the same page::

    page = render_inspect_html(InspectReport.from_json(Path("inspect.json").read_text()))
"""

from __future__ import annotations

from html import escape

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from ..compare.html import _FULL, _ROLES, _category_ticks, _figure, _new_axes
from ..compare.render import format_bytes, short_names
from ..page import page_html, rich_table_html
from .render import render_matmul_table, render_memory_table, render_notes
from .report import InspectReport

__all__ = ["render_inspect_html"]


def render_inspect_html(report: InspectReport) -> str:
    """The report as one self-contained HTML page (no network needed to view it)."""
    title = f"mixprec inspect: {report.workload}, batch {report.batch_size}"
    meta = [("workload", report.workload), ("device", report.device), ("batch", str(report.batch_size)),
            ("measured", "one real step per recipe" if report.measured else "no (predicted only)"),
            ("torch", report.torch_version), ("mixprec", report.mixprec_version)]
    notes = render_notes(report)
    fixes = [n for n in notes if n.startswith("fix ")]
    memory_caption = ("Predicted bytes by role for one training step, stacked per recipe; the number on top "
                      "is their sum (weights, gradients, fp32 masters, optimizer state and the activations "
                      "autograd saves)" + ("; the black bar: the measured total or CUDA peak." if report.measured
                                           else "."))
    fix_list = ('<ul class="notes" id="fixes">' + "".join(f"<li>{escape(f)}</li>" for f in fixes) + "</ul>"
                if fixes else "")
    parts = ['<h2 id="memory">Memory by role</h2>', rich_table_html(render_memory_table(report), table_id="memory-table"),
             _figure("plot-memory", _memory_plot(report), memory_caption),
             '<h2 id="tensor-cores">Tensor cores</h2>',
             rich_table_html(render_matmul_table(report), "x8 / x16: the dims that are not multiples of 8 "
                             "(fp16/bf16 tensor cores) or 16 (fp8); ok where all are", table_id="matmul-table"),
             fix_list]
    others = [n for n in notes if not n.startswith("fix ")]
    return page_html(title, meta, parts, notes=others, extra_css="h2 { font-size: 18px; margin: 28px 0 10px; }")


def _memory_plot(report: InspectReport) -> Figure | str:
    if not report.memory:
        return "no recipes in this report"
    names = short_names((m.recipe, m.label) for m in report.memory)
    labels = [names[m.recipe] for m in report.memory]
    fig, ax = _new_axes(_FULL, 3.8)
    x = np.arange(len(report.memory))
    bottom = np.zeros(len(report.memory))
    for role, name, color in _ROLES:
        part = np.asarray([getattr(m.predicted, role) for m in report.memory], dtype=float)
        if part.any():
            ax.bar(x, part, bottom=bottom, color=color, width=0.6, label=name)
            bottom += part
    measured = [(i, m.measured.peak if m.measured.peak is not None else m.measured.total)
                for i, m in enumerate(report.memory) if m.measured is not None]
    if measured:
        ax.plot([i for i, _ in measured], [v for _, v in measured], linestyle="none", marker="_",
                markersize=30, markeredgewidth=2.5, color="black", label="measured", zorder=5)
    for i in x:
        ax.annotate(format_bytes(bottom[i]), (i, bottom[i]), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9)
    _category_ticks(ax, labels)
    ax.set_ylabel("bytes")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    ax.margins(y=0.18)
    ax.grid(False, axis="x")
    fig.legend(loc="outside upper center", ncols=6, fontsize=8.5, frameon=False)
    return fig

"""The HTML page of a TraceReport: every op of one forward and backward with its input and output
dtypes, a block of rows per module and phase (the console table), and the dtype counts under it.

One self-contained file like the other tools' pages (``lab/page.py``), rendered from the report alone::

    page = render_trace_html(TraceReport.from_json(Path("trace.json").read_text()))
"""

from __future__ import annotations

from ...recipe import get_recipe
from ..page import page_html, rich_table_html
from .render import render_trace
from .report import TraceReport

__all__ = ["render_trace_html"]


def render_trace_html(report: TraceReport) -> str:
    """The report as one self-contained HTML page (no network needed to view it)."""
    recipe = get_recipe(report.recipe)
    title = f"mixprec trace: {recipe.label} on {report.device}"
    calls = sum(r.count for r in report.records)
    meta = [("recipe", report.recipe), ("device", report.device), ("op calls", str(calls)),
            ("distinct rows", str(len(report.records)))]
    table = rich_table_html(render_trace(report, recipe),
                            "inputs: the dtypes of each op's floating-point tensor inputs; output: its first "
                            "output's; view ops are left out, casts show as _to_copy", table_id="trace-table")
    return page_html(title, meta, [table])

"""The skeleton every lab page shares: one self-contained HTML file (inline CSS, inline PNGs, no
network), a title, a row of facts about the run, and the tool's console tables as HTML tables.

Each tool's page is rendered from its typed report alone (``compare/html.py``, ``doctor/html.py``,
``inspect/html.py``, ``trace/html.py``); this module only holds what they share::

    page_html("mixprec trace: mlp under bf16", [("device", "cpu")], [rich_table_html(table)])
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from rich.table import Table

__all__ = ["CSS", "page_html", "rich_table_html"]

CSS = """
body { margin: 0; background: #fff; color: #1a1a1a;
       font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width: 1040px; margin: 0 auto; padding: 24px 20px 48px; }
h1 { font-size: 22px; margin: 0 0 12px; }
.meta { display: flex; flex-wrap: wrap; gap: 6px 22px; margin: 0 0 12px; }
.meta div { display: flex; gap: 6px; } .meta dt { color: #666; } .meta dd { margin: 0; font-weight: 600; }
.notes { margin: 0 0 16px; padding: 8px 12px 8px 28px; background: #fff8e1; border-left: 4px solid #f0b400;
         font-size: 13.5px; color: #444; }
table { border-collapse: collapse; margin: 0 0 24px; font-variant-numeric: tabular-nums; }
caption { text-align: left; color: #666; font-size: 13.5px; padding-bottom: 4px; }
th, td { padding: 4px 12px; border-bottom: 1px solid #e3e3e3; white-space: nowrap; }
th { border-bottom: 2px solid #999; font-weight: 600; }
.left { text-align: left; } .right { text-align: right; } .center { text-align: center; }
figure { margin: 0 0 28px; } figure img { display: block; max-width: 100%; height: auto; }
figcaption { font-size: 13.5px; color: #444; margin-top: 4px; }
.empty { padding: 24px; background: #f6f6f6; color: #666; text-align: center; }
.pair { display: flex; gap: 20px; } .pair figure { flex: 1 1 0; min-width: 0; }
@media (max-width: 760px) { .pair { flex-direction: column; } }
p.below { font-size: 13.5px; color: #444; margin: -18px 0 24px; white-space: pre-line; }
""".strip()


def page_html(title: str, meta: Sequence[tuple[str, str]], parts: Sequence[str], *, notes: Sequence[str] = (),
              extra_css: str = "") -> str:
    """A whole page: ``title``, the ``meta`` facts, ``notes`` (plain text, one item each), then ``parts``
    (HTML, in order). Plain text is escaped here; ``parts`` are the caller's HTML."""
    items = "".join(f"<li>{escape(n)}</li>" for n in notes)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title>", f"<style>{CSS}" + (f"\n{extra_css}" if extra_css else "") + "</style>",
        "</head>", "<body>", "<main>", f"<h1>{escape(title)}</h1>",
        '<dl class="meta">' + "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>"
                                      for k, v in meta) + "</dl>",
        f'<ul class="notes">{items}</ul>' if items else "",
        *parts, "</main>", "</body>", "</html>", ""])


def rich_table_html(table: Table, caption: str = "", *, table_id: str | None = None) -> str:
    """A rich Table's title, headers and cells as an HTML table, with the table's own caption (rich's
    text below the table) as a paragraph after it; ``caption`` is HTML, added after the title."""
    cols = table.columns
    head = "".join(f'<th class="{c.justify}">{escape(str(c.header))}</th>' for c in cols)
    cells = [list(c.cells) for c in cols]
    rows = "".join("<tr>" + "".join(f'<td class="{c.justify}">{escape(str(cells[j][i]))}</td>'
                                    for j, c in enumerate(cols)) + "</tr>" for i in range(table.row_count))
    title = escape(str(table.title)) if table.title else ""
    head_caption = ". ".join(filter(None, [title, caption]))
    below = f'<p class="below">{escape(str(table.caption))}</p>' if table.caption else ""
    ident = f' id="{escape(table_id)}"' if table_id else ""
    return (f"<table{ident}><caption>{head_caption}</caption><thead><tr>{head}</tr></thead><tbody>{rows}</tbody>"
            f"</table>{below}")

"""The what-if of a doctor report (``doctor --what-if``): its table, its advice, its HTML heat map.

``what_if.py`` measures; this module renders ``report.what_if``, layers down and formats across::

    console.print(render_what_if_table(report))   # per cell: SQNR out/grad_W dB, then flushed|saturated
    for line in what_if_lines(report):            # the rule, per layer the advice, one line for the model
        print("-", line)
    what_if_section(report)                       # the page's section: heat map, advice, full table

A cell's first line is the SQNR (dB, against the bf16 GEMM) of the layer's output and of its weight
gradient; its second the largest share of x, W and g that the format flushes to zero, then the largest
share it saturates. The advised format (the cheapest the layer tolerates) is marked ``*``; formats the
layer does not tolerate (an SQNR below the floor, or anything saturated) are red in the terminal.
"""

from __future__ import annotations

import dataclasses
import math
from html import escape

from rich import box
from rich.table import Table
from rich.text import Text

from ...fp8.linear import ROLES
from ...fp8.swap import padded_shape
from ...recipe import RECIPES
from .render import percent_text
from .report import DoctorReport
from .what_if import format_bits
from .what_if_report import FORMATS, GRAD_SNR_FLOOR, FormatWhatIf, WhatIfReport

__all__ = ["render_what_if_table", "what_if_lines", "grad_snr_line", "what_if_section", "model_formats", "cost_order"]

_ROLE_SHORT = {"input": "x", "weight": "W", "grad_output": "g"}


def _db(v: float) -> str:
    return "NaN" if math.isnan(v) else f"{v:.1f}"        # inf prints as "inf"


def cost_order(w: WhatIfReport) -> list[str]:
    """FORMATS cheapest first: by the mean over the report's layers of their bits per element (on a
    1024x1024 layer when there is none: nvfp4, fp8, fp8-rowwise, fp8-block, mxfp8)."""
    def bits(f: str) -> float:
        if not w.layers:
            return format_bits(f, 1024, 1024)
        return sum(layer.result(f).bits for layer in w.layers) / len(w.layers)
    return sorted(FORMATS, key=lambda f: (bits(f), FORMATS.index(f)))


def _why_not(r: FormatWhatIf, floor_db: float) -> str:
    """Why a layer does not tolerate a format: which SQNR is below the floor, which operand saturates."""
    out = [f"{what} SQNR {_db(v)} dB" for what, v in (("output", r.sqnr_out_db), ("grad_W", r.sqnr_grad_w_db))
           if not v >= floor_db]
    out += [f"saturates {percent_text(c[1] / c[2])} of {_ROLE_SHORT[role]}" for role, c in r.counts.items() if c[1]]
    if r.grad_snr < GRAD_SNR_FLOOR:
        out.append(f"end-to-end gradient SNR {r.grad_snr:.2f} < sqrt(3)")
    return ", ".join(out)


def _snr_measured(w: WhatIfReport) -> bool:
    return any(not math.isnan(r.grad_snr) for layer in w.layers for r in layer.formats)


def _snr(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1f}"


def grad_snr_line(w: WhatIfReport) -> str | None:
    """Per format, the smallest end-to-end gradient SNR over the layers and where; None if unmeasured."""
    parts = []
    for f in dict.fromkeys(r.format for layer in w.layers for r in layer.formats):    # FORMATS order
        measured = [(r.grad_snr, layer.name) for layer in w.layers for r in layer.formats
                    if r.format == f and not math.isnan(r.grad_snr)]
        if measured:
            v, name = min(measured)
            below = sum(1 for x, _ in measured if x < GRAD_SNR_FLOOR)
            parts.append(f"{f} {v:.1f} ({name})" + (f", below sqrt(3) in {below} layer(s)" if below else ""))
    if not parts:
        return None
    return ("what-if, end-to-end gradient SNR |g| / |g_f - g| (the whole model in the format against fp32, "
            "same weights and batch; below sqrt(3) = 1.73 quantization outweighs the gradient; it falls as "
            "the loss does, so a long run goes lower than these few steps): smallest per format: "
            + "; ".join(parts))


def render_what_if_table(report: DoctorReport) -> Table:
    """Layers down, formats across: SQNR out/grad_W (dB), then flushed|saturated (worst of x, W, g)."""
    w = _what_if(report)
    table = Table(title=f"what-if on step {w.step}'s batch: SQNR of output/grad_W against bf16 (dB); "
                        f"flushed|saturated, worst of x, W, g; "
                        + ("snr: end-to-end gradient SNR against fp32 (>= sqrt(3)); " if _snr_measured(w) else "")
                        + f"* = advice (floor {w.floor_db:g} dB)",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("layer", justify="left", no_wrap=True)
    order = cost_order(w)
    for f in order:
        table.add_column(f, justify="right", no_wrap=True)
    table.add_column("advice", justify="left", no_wrap=True)
    for layer in w.layers:
        advice = w.advice(layer)
        cells = []
        for r in (layer.result(f) for f in order):
            mark = "*" if r.format == advice else " "
            text = (f"{_db(r.sqnr_out_db)}/{_db(r.sqnr_grad_w_db)}{mark}\n"
                    f"{percent_text(r.flushed())}|{percent_text(r.saturated())} "
                    + ("" if math.isnan(r.grad_snr) else f"\nsnr {_snr(r.grad_snr)} "))
            cells.append(Text(text, style="" if r.tolerated(w.floor_db) else "red"))
        name = layer.name + ("" if layer.rows == layer.rows_total else f" ({layer.rows}/{layer.rows_total} rows)")
        table.add_row(name, *cells, advice)
    return table


def model_formats(w: WhatIfReport) -> tuple[str | None, tuple[str, tuple[str, ...]] | None]:
    """(the cheapest format every layer the fp8 swap can take tolerates or None, (a cheaper format at
    least half of those layers tolerate, the layers that do not) or None); cheapest in ``cost_order``.
    Layers the swap cannot take (``LayerWhatIf.swappable``: dims not multiples of 16) stay in the base
    precision under any fp8 recipe, so they neither choose nor block one; with none left: (None, None)."""
    layers = [layer for layer in w.layers if layer.swappable]
    if not layers:
        return None, None
    order = cost_order(w)
    refusing = {f: tuple(layer.name for layer in layers if not layer.result(f).tolerated(w.floor_db))
                for f in order}
    everyone = next((f for f in order if not refusing[f]), None)
    cheaper = order[:order.index(everyone)] if everyone is not None else order
    most = next((f for f in cheaper if 0 < len(refusing[f]) <= len(layers) / 2), None)
    return everyone, (most, refusing[most]) if most is not None else None


def _unswappable_text(layers) -> str:
    return ", ".join(f"{layer.name!r} ({layer.out_features}, {layer.in_features}): pad to "
                     f"{padded_shape(layer.out_features, layer.in_features)}" for layer in layers)


def _recipe(fmt: str, skip: tuple[str, ...] = ()) -> str:
    if not skip:
        return f"--recipe {fmt}"
    config = RECIPES[fmt].fp8
    assert config is not None
    return f"--recipe '{fmt},fp8={dataclasses.replace(config, skip=config.skip + skip)}'"


def what_if_lines(report: DoctorReport) -> list[str]:
    """The rule, the sampling, per layer the advice (and why not the cheaper formats), the whole model."""
    w = _what_if(report)
    if not w.layers:
        return ["what-if: no linear layer (nn.Linear, HF Conv1D) received a gradient in the captured step"]
    out = [f"what-if: a layer tolerates a format when the SQNR of its output and of its weight gradient, "
           f"each against the bf16 GEMM, is at least {w.floor_db:g} dB (--what-if-floor) and nothing "
           f"saturates; measured on step {w.step}'s batch in {w.seconds:.2f} s"]
    if w.subsampled:
        out.append(f"what-if: {len(w.subsampled)} layer(s) measured on their first {w.max_rows} rows of x and "
                   f"g only (--what-if-rows): {', '.join(repr(layer.name) for layer in w.subsampled)}")
    for layer in w.layers:
        best = layer.cheapest(w.floor_db)
        chosen = FORMATS if best is None else [r.format for r in layer.formats
                                               if (r.bits, FORMATS.index(r.format)) <
                                               (best.bits, FORMATS.index(best.format))]
        why = "; ".join(f"{f}: {_why_not(layer.result(f), w.floor_db)}" for f in chosen)
        head = (f"{best.format} ({best.bits:.2f} bits/element, SQNR {_db(best.sqnr_out_db)}/"
                f"{_db(best.sqnr_grad_w_db)} dB)" if best else "bf16: no format is tolerated")
        out.append(f"what-if {layer.name!r}: {head}" + (f" (not {why})" if why else "")
                   + ("" if layer.swappable else
                      f"; but no fp8 recipe can take this layer: its weight ({layer.out_features}, "
                      f"{layer.in_features}) (out, in) is not in multiples of 16, so it stays in the base "
                      f"precision (pad it to {padded_shape(layer.out_features, layer.in_features)})"))
    snr_line = grad_snr_line(w)
    if snr_line:
        out.append(snr_line)
    everyone, most = model_formats(w)
    fixed = [layer for layer in w.layers if not layer.swappable]
    if len(fixed) == len(w.layers):
        out.append(f"what-if, whole model: no fp8 recipe can take any of its {len(w.layers)} measured "
                   f"layer(s): the fp8 swap needs both weight dimensions (out, in) in multiples of 16 "
                   f"({_unswappable_text(fixed)}); pad them, or keep a recipe without fp8 (e.g. bf16)")
        return out
    some = "every layer" if not fixed else f"every layer the fp8 swap can take ({len(w.layers) - len(fixed)})"
    line = (f"what-if, whole model: {some} tolerates {everyone} ({_recipe(everyone)})" if everyone
            else f"what-if, whole model: no format suits {some}")
    if most is not None:
        fmt, skip = most
        line += (f"; {fmt} suits all but {len(skip)} of {len(w.layers) - len(fixed)} layers, which would stay "
                 f"in the base precision: {_recipe(fmt, skip)}")
    if fixed:
        line += (f"; {len(fixed)} layer(s) stay in the base precision under any fp8 recipe, their weight "
                 f"dimensions not multiples of 16: {_unswappable_text(fixed)}")
    out.append(line)
    return out


def _what_if(report: DoctorReport) -> WhatIfReport:
    if report.what_if is None:
        raise ValueError("this doctor report has no what-if; run mixprec doctor --what-if")
    return report.what_if


# --------------------------------------------------------------------------------------- HTML
def what_if_section(report: DoctorReport) -> str:
    """The page's what-if section: the heat map, the advice and every number; "" without a what-if."""
    if report.what_if is None:
        return ""
    from ..compare.html import _figure  # matplotlib: only when a page is made
    w = report.what_if
    notes = "".join(f"<li>{escape(line)}</li>" for line in what_if_lines(report))
    caption = (f"Per layer (rows) and format (columns): colour = the lower of the output and weight-gradient "
               f"SQNR against the bf16 GEMM, in dB (green above the {w.floor_db:g} dB floor, red below); "
               "text = output/grad_W SQNR, in red bold where the layer does not tolerate the format; hatched: "
               "the format saturates some value; black frame: the "
               "advice, the cheapest format the layer tolerates. Columns cheapest first (mean bits per "
               "element over the layers, scales included).")
    return ('<h2 id="what-if">What-if: each layer in each format</h2>'
            + f'<ul class="notes">{notes}</ul>' + _figure("plot-what-if", _heat_map(w), caption)
            + _detail_table(w))


def _heat_map(w: WhatIfReport):     # -> Figure | str
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    from ..compare.html import _FULL, _new_figure, _text
    if not w.layers:
        return "no linear layer received a gradient in the captured step"
    order = cost_order(w)
    n = len(w.layers)
    values = np.array([[layer.result(f).sqnr_min_db for f in order] for layer in w.layers], dtype=float)
    lo, hi = w.floor_db - 10, w.floor_db + 20     # below the floor turns red within 10 dB
    shown = np.nan_to_num(values, nan=lo, posinf=hi, neginf=lo)
    fig = _new_figure(_FULL, 1.3 + 0.42 * n)
    ax = fig.add_subplot()
    norm = TwoSlopeNorm(vcenter=w.floor_db, vmin=lo, vmax=hi)
    image = ax.imshow(np.clip(shown, lo, hi), cmap="RdYlGn", norm=norm, aspect="auto")
    for i, layer in enumerate(w.layers):
        advice = w.advice(layer)
        for j, f in enumerate(order):
            r = layer.result(f)
            ok = r.tolerated(w.floor_db)
            ax.text(j, i, f"{_db(r.sqnr_out_db)} / {_db(r.sqnr_grad_w_db)}", ha="center", va="center",
                    fontsize=8, color="#111" if ok else "#a00000", fontweight="normal" if ok else "bold")
            if r.saturated() > 0:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#555",
                                       linewidth=0))
            if f == advice:
                ax.add_patch(Rectangle((j - 0.47, i - 0.47), 0.94, 0.94, fill=False, edgecolor="black",
                                       linewidth=2))
    ax.set_xticks(range(len(order)), [f"{f}\n{sum(layer.result(f).bits for layer in w.layers) / n:.2f} b"
                                      for f in order])
    ax.set_yticks(range(n), [_text(layer.name or "(model)") for layer in w.layers])
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("min SQNR, dB")
    return fig


def _detail_table(w: WhatIfReport) -> str:
    """Every layer and format: bits, both SQNRs, flushed and saturated shares of x, W and g."""
    head = ["layer", "format", "bits", "SQNR out", "SQNR grad_W", "grad SNR", "sign"] + [
        f"{kind} {_ROLE_SHORT[r]}" for kind in ("flushed", "saturated") for r in ROLES]
    rows = []
    for layer in w.layers:
        advice = w.advice(layer)
        for j, r in enumerate(layer.formats):
            cells = [layer.name if j == 0 else "", r.format + (" *" if r.format == advice else ""),
                     f"{r.bits:.2f}", _db(r.sqnr_out_db), _db(r.sqnr_grad_w_db), _snr(r.grad_snr),
                     "-" if math.isnan(r.grad_sign) else f"{r.grad_sign:.3f}"]
            cells += [percent_text(r.flushed(role)) for role in ROLES]
            cells += [percent_text(r.saturated(role)) for role in ROLES]
            cls = ' class="first"' if j == 0 else ""
            rows.append(f"<tr{cls}>" + "".join(f'<td class="{"left" if i < 2 else "right"}">{escape(c)}</td>'
                                               for i, c in enumerate(cells)) + "</tr>")
    ths = "".join(f'<th class="{"left" if i < 2 else "right"}">{escape(h)}</th>' for i, h in enumerate(head))
    rows_note = (f" Layers with more than {w.max_rows} rows (batch x positions) are measured on their first "
                 f"{w.max_rows}." if w.subsampled else "")
    return (f'<table class="formats" id="what-if-table"><caption>Per layer and format: bits per element '
            "(scales included), SQNR in dB of the output and the weight gradient against the bf16 GEMM, and "
            "the exact shares of x, W and g flushed to zero (nonzero values) and saturated; * marks the advice."
            f"{escape(rows_note)}</caption><thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>")

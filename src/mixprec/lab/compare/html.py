"""The HTML page of a CompareReport: one self-contained file with the table and five plots.

    page = render_html(CompareReport.from_json(Path("runs/report.json").read_text()))
    Path("runs/report.html").write_bytes(page.encode())

Everything is inline (CSS, and the plots as base64 PNG), so the page opens offline and can be mailed
or attached to an issue. It is rendered from the typed report alone, and the same report always renders
to the same bytes: no dates, PNGs without the Software tag, and matplotlib's Agg canvas on each
``Figure`` directly (no pyplot, so no global figure registry and no backend switch).

Steps on every x axis count from 1: ``losses[i]`` is the loss of step ``i + 1``, ``scales[i]`` the loss
scale after it, and ``eval_steps`` already count the steps done.
"""

from __future__ import annotations

import base64
import io
import math
from html import escape

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, PercentFormatter

from ...recipe import get_recipe
from .render import BASELINE, failed, format_bytes, memory_figure, ratio_text, render_notes, render_table, short_names
from .report import CompareReport
from ..page import page_html
from ..trainer import RunResult

__all__ = ["render_html"]

_DPI = 150                 # PNG pixels per inch: crisp on high-density screens
_CSS_PX_PER_INCH = 100     # the page shows a figure at 100 CSS px per inch of figsize
_FULL, _HALF = 10.4, 5.1   # figure widths in inches: the page column, and half of it beside another
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")      # matplotlib's tab10 without red, which marks trouble (skips, non-finite losses)
_TROUBLE = "#d62728"
_MANY_RUNS = 5             # above this many recipes the plots change: averages only, bar charts full width
# Recipes often train to the same curve: each one's line is thinner and differently dashed than the
# one drawn before it, so coinciding lines stay visible as stripes instead of hiding each other.
_DASHES = ("solid", (0, (5, 2)), (0, (1, 1.4)), (0, (6, 2, 1, 2)), (0, (3, 1, 1, 1, 1, 1)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")
_ROLES = (("params", "weights", "#4c72b0"), ("grads", "gradients", "#dd8452"),
          ("master", "fp32 masters", "#55a868"), ("optimizer", "optimizer state", "#8172b3"),
          ("activations", "saved activations", "#937860"))


def render_html(report: CompareReport) -> str:
    """The report as one self-contained HTML page: header, notes, table and plots (no network needed)."""
    names = short_names((r.recipe, r.label) for r in report.runs)
    labels = [names[r.recipe] for r in report.runs]
    rate = "tokens/s" if report.tokens_per_sample else "samples/s"
    better = "higher" if report.higher_is_better else "lower"
    window = _window(report.steps)
    unscaled = [n for r, n in zip(report.runs, labels) if not _scaled(r)]
    # Runs that skipped every step never trained: their loss and metric are not results, so the loss
    # and metric plots leave them out (each run keeps its colour) and say so.
    hidden = frozenset(i for i, r in enumerate(report.runs) if failed(report, r))
    left_out = (f" Left out: {', '.join(labels[i] for i in sorted(hidden))} (every step skipped for an inf/NaN "
                "gradient norm, so not results)." if hidden else "")
    none_trained = bool(report.runs) and len(hidden) == len(report.runs)    # captions without a plot to read
    figures = [
        _figure("plot-loss", _loss_plot(report.runs, labels, window, hidden),
                ("Train loss: none to plot." if none_trained else _loss_caption(report, window)) + left_out),
        _figure("plot-eval", _eval_plot(report, labels, hidden),
                (f"Test {report.metric}: none to plot." if none_trained else
                 f"Test {report.metric} measured during training, one point per evaluation: {better} is "
                 f"better, and the last point is the table's test {report.metric}.") + left_out),
        _figure("plot-scale", _scale_plot(report.runs, labels),
                "Loss scale after each step (log2 axis) for the recipes that scale the loss: it drops "
                "on each step skipped for an inf/NaN gradient (red x) and grows after a run of clean "
                "steps" + (f"; {', '.join(unscaled)}: no loss scaling." if unscaled else ".")),
        _figure("plot-throughput", _throughput_plot(report, labels, rate),
                f"Training {rate} per recipe (warm-up steps excluded), with the ratio to {BASELINE} "
                "when it ran: taller is faster."),
        _figure("plot-memory", _memory_plot(report.runs, labels),
                "Bytes held by role on the first step taken, stacked per recipe; the number on top is the "
                "table's memory figure" + (", the CUDA allocator's peak for the run, which the black bar "
                                           "marks." if any(r.memory.peak is not None for r in report.runs)
                                           else ", their sum.")),
    ]
    title = f"mixprec compare: {report.workload} on {report.device}"
    meta = [("workload", report.workload), ("device", f"{report.device} ({report.device_name})"),
            ("steps x batch", f"{report.steps} x {report.batch_size}"), ("seed", str(report.seed)),
            ("torch", report.torch_version), ("mixprec", report.mixprec_version),
            ("threads", str(report.threads))]
    bars = (f'<div class="pair">{figures[3]}{figures[4]}</div>' if _bars_width(len(report.runs)) == _HALF
            else figures[3] + figures[4])          # many recipes: each bar chart the page's width
    parts = [_table(report), figures[0], figures[1], figures[2], bars]
    return page_html(title, meta, parts, notes=render_notes(report))


# ------------------------------------------------------------------------------------ the page


def _loss_caption(report: CompareReport, window: int) -> str:
    if window > 1 and _shows_raw(len(report.runs)):
        lines = f"faint lines are each minibatch's loss, solid lines a centred {window}-step moving average"
    elif window > 1:
        lines = (f"lines are a centred {window}-step moving average (with more than {_MANY_RUNS} recipes each "
                 "minibatch's own loss is left out: their faint lines would hide the averages)")
    else:
        lines = "lines are each minibatch's loss"
    if len(report.runs) > 1 and any(r.label == BASELINE for r in report.runs):
        lines += (f"; the lower panel is each recipe's loss minus {BASELINE}'s at the same step, smoothed "
                  "alike (same batches and initial weights, so the difference is the recipe's doing)")
    if any(not math.isfinite(v) for r in report.runs for v in r.losses):
        lines += ("; a red triangle on the top edge marks the step where a run's loss first became NaN "
                  "or infinite (those steps are left out of the curves)")
    return f"Train loss at every step, one colour per recipe: {lines}."


def _table(report: CompareReport) -> str:
    """The console table's columns and cells (``render_table``), as an HTML table."""
    table = render_table(report)
    columns = table.columns
    head = "".join(f'<th class="{c.justify}">{escape(str(c.header))}</th>' for c in columns)
    cells = [list(c.cells) for c in columns]
    rows = []
    for i, run in enumerate(report.runs):
        # The first cell is the recipe's short name; hovering it shows the full recipe string.
        tds = [f'<td class="{columns[0].justify}" title="{escape(run.recipe)}">{escape(str(cells[0][i]))}'
               "</td>"]
        tds += [f'<td class="{c.justify}">{escape(str(cells[j][i]))}</td>'
                for j, c in enumerate(columns) if j > 0]
        rows.append(f"<tr>{''.join(tds)}</tr>")
    return (f"<table><caption>{escape(str(table.title))}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def _figure(plot_id: str, fig: Figure | str, caption: str) -> str:
    """A ``<figure>``: the plot as an inline PNG, or the message saying why there is nothing to plot."""
    if isinstance(fig, str):
        body = f'<p class="empty">{escape(fig)}</p>'
    else:
        width, height = (round(v * _CSS_PX_PER_INCH) for v in fig.get_size_inches())
        body = (f'<img alt="{plot_id.removeprefix("plot-")} plot" width="{width}" height="{height}" '
                f'src="data:image/png;base64,{_png(fig)}">')
    return f'<figure id="{plot_id}">{body}<figcaption>{escape(caption)}</figcaption></figure>'


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    # No Software tag (it names matplotlib's version): the same report gives the same bytes.
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ----------------------------------------------------------------------------------- the plots
def _new_axes(width: float, height: float) -> tuple[Figure, Axes]:
    fig = _new_figure(width, height)
    return fig, _style(fig.add_subplot())


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)          # Agg, attached to this figure only: no global backend state
    return fig


def _style(ax: Axes) -> Axes:
    ax.grid(True, color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


def _text(s: str) -> str:
    """Report text for matplotlib, which would read ``$...$`` as math."""
    return s.replace("$", r"\$")


def _color(i: int) -> str:
    return _COLORS[i % len(_COLORS)]


def _line(i: int, n: int) -> dict:
    """Colour, dashes and width of run ``i`` of ``n``: later runs thinner, drawn on top."""
    return {"color": _color(i), "linestyle": _DASHES[i % len(_DASHES)],
            "linewidth": 1.4 + 1.6 * (n - 1 - i) / max(n - 1, 1)}


def _shows_raw(n_runs: int) -> bool:
    """Whether the loss plot draws each minibatch's loss beside the averages: up to _MANY_RUNS recipes."""
    return n_runs <= _MANY_RUNS


def _category_ticks(ax: Axes, labels: list[str]) -> None:
    """One x tick per recipe, its name under it."""
    ax.set_xticks(np.arange(len(labels)), [_text(s) for s in labels])


def _bars_width(n_runs: int) -> float:
    """A bar chart's width: half the page beside its neighbour, the whole page for more than _MANY_RUNS
    recipes (seven names such as fp16-pure overlapped in half of it)."""
    return _HALF if n_runs <= _MANY_RUNS else _FULL


def _window(steps: int) -> int:
    """The moving average's width: about 2% of the run, odd so that it centres on a step."""
    return max(1, steps // 50) | 1


def _moving_average(y: np.ndarray, window: int) -> np.ndarray:
    """Centred mean over ``window`` steps of the finite values in ``y``; NaN where ``y`` is not finite."""
    finite = np.isfinite(y)
    kernel = np.ones(window)
    total = np.convolve(np.where(finite, y, 0.0), kernel, mode="same")
    count = np.convolve(finite.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite, total / count, np.nan)


def _loss_plot(runs: tuple[RunResult, ...], labels: list[str], window: int,
               hidden: frozenset[int] = frozenset()) -> Figure | str:
    """The loss curves of ``runs`` but those at the indices in ``hidden`` (colours stay by index)."""
    if not any(r.losses for r in runs):
        return "no losses recorded"
    shown = [r for i, r in enumerate(runs) if i not in hidden]
    if not any(math.isfinite(v) for r in shown for v in r.losses):
        # An empty axis (matplotlib's 0.96..1.04) would look like a plot of something.
        return ("no run trained: every step of every run was skipped for an inf/NaN gradient norm, so there is no "
                "loss to plot" if not shown else "no finite loss to plot: every recorded loss is NaN or infinite")
    base = next((r for r in shown if r.label == BASELINE), None)
    others = [r for r in shown if r is not base and r.losses]
    fig = _new_figure(_FULL, 5.4 if base is not None and others else 4.2)
    if base is not None and others:
        ax, diff_ax = (_style(a) for a in fig.subplots(2, 1, sharex=True, height_ratios=[2.3, 1]))
    else:
        ax, diff_ax = _style(fig.add_subplot()), None
    positive = True
    for i, (r, label) in enumerate(zip(runs, labels)):
        if i in hidden:
            continue
        y = np.asarray(r.losses, dtype=float)
        x = np.arange(1, len(y) + 1)
        finite = np.isfinite(y)
        positive &= bool(np.all(y[finite] > 0))
        bad = np.flatnonzero(~finite)
        if bad.size:
            label += f" (non-finite from step {x[bad[0]]})"
            # On the top edge (axes coordinates in y), so it shows whatever the loss's range.
            ax.plot([x[bad[0]]], [1.0], marker="v", markersize=9, color=_TROUBLE, clip_on=False,
                    transform=ax.get_xaxis_transform(), zorder=5)
            ax.axvline(x[bad[0]], color=_color(i), linestyle=":", linewidth=1.2)
        if _shows_raw(len(runs)) and window > 1:          # (a 1-step average is the raw loss itself)
            ax.plot(x, np.where(finite, y, np.nan), color=_color(i), alpha=0.18, linewidth=0.8)
        ax.plot(x, _moving_average(y, window), label=_text(label), **_line(i, len(runs)))
        if diff_ax is not None and r is not base:
            # Same batches, same initial weights: the per-step difference is the recipe's doing.
            n = min(len(y), len(base.losses))
            d = y[:n] - np.asarray(base.losses[:n], dtype=float)
            diff_ax.plot(x[:n], _moving_average(d, window), **_line(i, len(runs)))
    if positive:
        ax.set_yscale("log")
    ax.set_ylabel("train loss")
    ax.margins(x=0.01)
    if _shows_raw(len(runs)):
        ax.legend(loc="upper right", framealpha=0.9)
    else:       # many recipes: a legend inside would cover the curves
        fig.legend(loc="outside right upper", frameon=False, fontsize=8.5)
    if diff_ax is not None:
        diff_ax.axhline(0.0, color=_color(runs.index(base)), linewidth=1.0)
        diff_ax.set_ylabel(f"minus {BASELINE}'s")
    (diff_ax or ax).set_xlabel("step")
    return fig


def _eval_plot(report: CompareReport, labels: list[str], hidden: frozenset[int] = frozenset()) -> Figure | str:
    if not any(r.eval_steps for r in report.runs):
        return "no evaluations recorded"
    if len(hidden) == len(report.runs):
        return (f"no run trained: every step of every run was skipped for an inf/NaN gradient norm, so no test "
                f"{report.metric} is a result")
    fig, ax = _new_axes(_FULL, 3.6)
    for i, (r, label) in enumerate(zip(report.runs, labels)):
        if i in hidden:
            continue
        n = min(len(r.eval_steps), len(r.eval_metrics))     # equal in any report compare wrote
        y = np.asarray(r.eval_metrics[:n], dtype=float)
        ok = np.isfinite(y)
        ax.plot(np.asarray(r.eval_steps[:n], dtype=float)[ok], y[ok], marker=_MARKERS[i % len(_MARKERS)],
                markersize=4 + 3 * (len(report.runs) - 1 - i) / max(len(report.runs) - 1, 1),
                label=_text(label), **_line(i, len(report.runs)))
    if report.metric == "accuracy":
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.set_xlabel("step")
    ax.set_ylabel(_text(f"test {report.metric} ({'higher' if report.higher_is_better else 'lower'} "
                        "is better)"))
    ax.set_xlim(0, max(report.steps, 1) * 1.01)
    ax.legend(loc="lower right" if report.higher_is_better else "upper right", framealpha=0.9)
    return fig


def _scaled(run: RunResult) -> bool:
    return get_recipe(run.recipe).loss_scale.kind != "none"


def _scale_plot(runs: tuple[RunResult, ...], labels: list[str]) -> Figure | str:
    scaled = [(i, r, label) for i, (r, label) in enumerate(zip(runs, labels)) if _scaled(r)]
    if not scaled:
        return (f"no loss scaling in any recipe here ({', '.join(labels)}): no scale to plot"
                if runs else "no runs in this report")
    fig, ax = _new_axes(_FULL, 3.4)
    values = []
    for i, r, label in scaled:
        y = np.asarray(r.scales, dtype=float)
        x = np.arange(1, len(y) + 1)
        ok = np.isfinite(y) & (y > 0)
        values += list(y[ok])
        ax.plot(x[ok], y[ok], drawstyle="steps-post", label=_text(f"{label} ({r.skipped_steps} skipped)"),
                **_line(i, len(runs)))
        skipped = np.asarray([s for s in r.skipped_at if 0 <= s < len(y) and ok[s]], dtype=int)
        ax.plot(x[skipped], y[skipped], linestyle="none", marker="x", markersize=7, markeredgewidth=1.6,
                color=_TROUBLE, zorder=5)
    handles, texts = ax.get_legend_handles_labels()
    if any(r.skipped_at for _, r, _ in scaled):
        handles.append(Line2D([], [], linestyle="none", marker="x", markeredgewidth=1.6, color=_TROUBLE))
        texts.append("skipped step")
    for r, label in zip(runs, labels):
        if not _scaled(r):
            handles.append(Line2D([], [], linestyle="none"))
            texts.append(_text(f"{label}: no loss scaling"))
    ax.set_yscale("log", base=2)
    if values:   # a factor of 2 either side, so a constant scale still gets ticks around it
        ax.set_ylim(min(values) / 2, max(values) * 2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.margins(x=0.01)
    # Beside the axes: scale lines run the full width, so any corner inside would hide a skip mark.
    ax.legend(handles, texts, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              frameon=False)
    return fig


def _throughput_plot(report: CompareReport, labels: list[str], rate: str) -> Figure | str:
    if not report.runs:
        return "no runs in this report"
    per = report.tokens_per_sample or 1
    base = next((r for r in report.runs if r.label == BASELINE), None)
    fig, ax = _new_axes(_bars_width(len(report.runs)), 3.8)
    speeds = [r.samples_per_s * per if math.isfinite(r.samples_per_s) else 0.0 for r in report.runs]
    bars = ax.bar(range(len(speeds)), speeds, color=[_color(i) for i in range(len(speeds))], width=0.65)
    notes = []
    for r, v in zip(report.runs, speeds):
        text = f"{v:,.0f}" if math.isfinite(r.samples_per_s) else "-"
        if base is not None:
            text += f"\n{ratio_text(r.samples_per_s, base.samples_per_s)}"
        notes.append(text)
    ax.bar_label(bars, labels=notes, padding=3, fontsize=9)
    _category_ticks(ax, labels)
    ax.set_ylabel(rate)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.margins(y=0.22)
    ax.grid(False, axis="x")
    return fig


def _memory_plot(runs: tuple[RunResult, ...], labels: list[str]) -> Figure | str:
    if not runs:
        return "no runs in this report"
    fig, ax = _new_axes(_bars_width(len(runs)), 3.8)
    x = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for role, name, color in _ROLES:
        part = np.asarray([getattr(r.memory, role) for r in runs], dtype=float)
        if part.any():
            ax.bar(x, part, bottom=bottom, color=color, width=0.65, label=name)
            bottom += part
    peaks = [(i, r.memory.peak) for i, r in enumerate(runs) if r.memory.peak is not None]
    if peaks:
        ax.plot([i for i, _ in peaks], [p for _, p in peaks], linestyle="none", marker="_", markersize=30,
                markeredgewidth=2.5, color="black", label="CUDA peak", zorder=5)
    base = next((r for r in runs if r.label == BASELINE), None)
    for i, r in enumerate(runs):
        text = format_bytes(memory_figure(r))
        if base is not None:
            text += f"\n{ratio_text(memory_figure(r), memory_figure(base))}"
        top = max(bottom[i], r.memory.peak or 0)
        ax.annotate(text, (i, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=9)
    _category_ticks(ax, labels)
    ax.set_ylabel("bytes")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    ax.margins(y=0.22)
    ax.grid(False, axis="x")
    fig.legend(loc="outside upper center", ncols=3, fontsize=8.5, frameon=False)
    return fig

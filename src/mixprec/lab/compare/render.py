"""The console view of a CompareReport: the rich table, the notes under it, and the names and units
they share with inspect's tables and compare's page (``short_names``, ``format_bytes``, ``ratio_text``).

The table is rendered from the report, never scraped from the console.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rich import box
from rich.table import Table

from ...recipe import get_recipe
from ..trainer import RunResult
from .report import CompareReport

__all__ = ["BASELINE", "render_table", "render_notes", "short_names", "memory_figure", "format_bytes",
           "ratio_text", "failed"]

BASELINE = "fp32"          # the run that speed and memory ratios compare against


def render_table(report: CompareReport) -> Table:
    """The comparison as a rich Table: one row per recipe, a speedup column when fp32 ran."""
    baseline = next((r for r in report.runs if r.label == BASELINE), None)
    # No vertical rules and no edge padding: seven columns fit an 80-column log or pipe unwrapped.
    table = Table(title=f"{report.workload} on {report.device} ({report.device_name}): {report.steps} "
                        f"steps x batch {report.batch_size}, seed {report.seed}",
                  caption=_speed_note(report) if report.runs else None, caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("recipe", no_wrap=True)
    table.add_column("loss", justify="right", no_wrap=True)
    table.add_column(f"test {_short(report.metric)}", justify="right", no_wrap=True)
    rate = "tokens/s" if report.tokens_per_sample else "samples/s"
    per = report.tokens_per_sample or 1
    table.add_column(rate, justify="right", no_wrap=True)
    if baseline is not None:
        table.add_column("speed", justify="right", no_wrap=True)
    table.add_column("memory", justify="right", no_wrap=True)
    if baseline is not None:
        table.add_column("mem", justify="right", no_wrap=True)
    table.add_column("skips", justify="right", no_wrap=True)
    table.add_column("scale", justify="right", no_wrap=True)
    names = short_names((r.recipe, r.label) for r in report.runs)
    for r in report.runs:
        row = [names[r.recipe], _loss_text(r.final_loss), _metric_text(report.metric, r.test_metric),
               f"{r.samples_per_s * per:,.0f}" if math.isfinite(r.samples_per_s) else "-"]
        if failed(report, r):       # no step was taken: its loss and metric are not results
            row[1:3] = ["failed", "-"]
        if baseline is not None:
            row.append(ratio_text(r.samples_per_s, baseline.samples_per_s))
        row.append(format_bytes(memory_figure(r)))
        if baseline is not None:
            row.append(ratio_text(memory_figure(r), memory_figure(baseline)))
        row += [str(r.skipped_steps), _scale_text(r)]
        table.add_row(*row)
    return table


def failed(report: CompareReport, run: RunResult) -> bool:
    """True when every step of ``run`` was skipped for an inf/NaN gradient norm: the weights never moved."""
    steps = len(run.losses) or report.steps     # an interrupted run took fewer steps than planned
    return steps > 0 and run.skipped_steps >= steps


def memory_figure(run: RunResult) -> int:
    """The one memory number a table shows: the CUDA peak where measured, else the counted total."""
    return run.memory.peak if run.memory.peak is not None else run.memory.total


def format_bytes(n: float) -> str:
    """Bytes in decimal units (MB = 10**6 bytes: a million fp32 values are 4 MB)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def ratio_text(value: float, baseline: float) -> str:
    """``value / baseline`` as ``"1.23x"``; ``"-"`` where the ratio is not a finite number."""
    ratio = value / baseline if baseline > 0 else math.nan
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "-"


def render_notes(report: CompareReport) -> list[str]:
    """One-line notes to print under the table: what each custom recipe is, and caveats."""
    names = short_names((r.recipe, r.label) for r in report.runs)
    notes = [f"{names[r.recipe]}: {r.recipe}" for r in report.runs if names[r.recipe] != r.label]
    notes += [f"{names[r.recipe]} FAILED: all {report.steps} steps were skipped for an inf/NaN gradient norm, so "
              f"the weights never changed and its loss and {report.metric} are not results; "
              "'mixprec doctor' with this recipe, or MixedPrecision(..., trace_nonfinite=True), names the "
              "module and op where the first inf/NaN appeared" for r in report.runs if failed(report, r)]
    if report.partial:
        taken = sorted({len(r.losses) for r in report.runs})
        notes.append(f"PARTIAL: interrupted after {'-'.join(str(t) for t in dict.fromkeys((taken[0], taken[-1])))} of "
                     f"{report.steps} steps; each recipe above is reported at the steps it took")
    if report.synthetic:
        notes.append(f"note: {report.workload} trains on random data, for speed and memory; its "
                     f"{report.metric} only shows that the numbers stayed finite")
    if report.device.startswith("cpu"):
        notes.append("note: speed on CPU does not predict GPU tensor-core speed (16-bit matmuls are often "
                     "slower than fp32 on CPUs); the accuracy and memory figures still carry over")
    if any(r.memory.peak is None for r in report.runs):
        notes.append("loss: mean train loss over the last 10% of steps; memory: weights + gradients + "
                     "master copies + optimizer state + activations saved for backward, counted on the "
                     "first step taken (a skipped one has no optimizer state yet); speed and mem: "
                     "ratios to fp32")
    return notes


def _speed_note(report: CompareReport) -> str:
    """How the speed column was measured: side by side, or one recipe after another."""
    if report.turn_steps:
        return f"{_rate(report)}: measured in turns of {report.turn_steps} steps, all recipes alike"
    return f"{_rate(report)}: measured one recipe after another"


def _rate(report: CompareReport) -> str:
    return "tokens/s" if report.tokens_per_sample else "samples/s"


def short_names(recipes: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``(recipe string, label)`` pairs -> the name each recipe goes by in tables and progress bars.

    A named recipe goes by its name. A custom recipe's label is its full string, too wide for a
    column: it becomes ``custom-1``, ``custom-2``, ... and ``render_notes`` spells each one out.
    """
    names, custom = {}, 0
    for recipe, label in recipes:
        if label == recipe:
            custom += 1
            names[recipe] = f"custom-{custom}"
        else:
            names[recipe] = label
    return names


def _short(metric: str) -> str:
    return "acc" if metric == "accuracy" else metric


def _loss_text(loss: float) -> str:
    """Four decimals, or four significant digits for losses below 0.01 (beam's MSE is ~1e-9 m^2)."""
    return f"{loss:.4f}" if not math.isfinite(loss) or abs(loss) >= 0.01 or loss == 0 else f"{loss:.4g}"


def _metric_text(metric: str, value: float) -> str:
    return f"{100 * value:.1f}%" if metric == "accuracy" and math.isfinite(value) else f"{value:.4g}"


def _scale_text(r: RunResult) -> str:
    # A recipe without loss scaling has S = 1 throughout; "none" says why better than "1".
    if get_recipe(r.recipe).loss_scale.kind == "none":
        return "none"
    return f"{r.final_scale:.10g}"     # every digit of 2**24 = 16777216, not 1.67772e+07

"""CompareReport: the data a ``mixprec compare`` run yields, its JSON form, and its table.

The table (and, later, HTML) is rendered from the report, never scraped from the console.

JSON schema, version 1 (one object; floats that are not finite are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``, so the file is strict JSON that a browser can read)::

    schema_version   int      1; bumped when a field changes meaning or goes away
    workload         str      the workload's name, e.g. "mlp"
    metric           str      what test_metric measures, e.g. "accuracy" (a fraction in [0, 1])
    device           str      the torch device trained on, e.g. "cpu", "cuda:0"
    device_name      str      the hardware: GPU name, or the CPU's architecture
    threads          int      torch's intra-op CPU threads (speed on CPU depends on it)
    torch_version    str
    mixprec_version  str
    steps            int      optimizer steps per run (skipped ones included)
    batch_size       int
    tokens_per_sample int     tokens in one sample (sequence length) for language models, else 0
    higher_is_better bool     whether a larger test_metric is better (accuracy) or worse (a loss)
    synthetic        bool     random data (a benchmark): the metric only shows the numbers stayed finite
    seed             int      fixes the initial weights and the minibatch order, the same for every run
    partial          bool     the run was interrupted: runs holds only the recipes that finished
                              (optional when reading; false if absent)
    runs             list     one object per recipe, in the order run:
      recipe         str      the full recipe string (mixprec.parse_recipe reads it back)
      label          str      the recipe's name, or the full string for a custom recipe
      final_loss     float    mean train loss over the last 10% of steps
      test_metric    float    the workload's metric on its test set
      samples_per_s  float    training throughput, warm-up steps excluded
      skipped_steps  int      steps skipped for inf/NaN gradients
      final_scale    float    loss scale after the last step (1.0 without loss scaling)
      losses         [float]  train loss at every step
      scales         [float]  loss scale after every step
      skipped_at     [int]    0-based indices of the skipped steps
      wall_s         float    seconds for the run: build, train, evaluate (the first run also
                              pays torch's one-time lazy imports, about a second)
      eval_steps     [int]    steps after which the test metric was measured (the last step included)
      eval_metrics   [float]  the test metric at each of eval_steps
      memory         object   bytes by role, measured on the first step:
        params, grads, master, optimizer, activations   int
        peak         int|null the CUDA allocator's peak over the run; null on other devices

Reading a report back gives an equal one: ``CompareReport.from_json(report.to_json()) == report``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

from rich import box
from rich.table import Table

from ..diagnostics.memory import MemoryBreakdown
from ..recipe import get_recipe
from .strict_json import decode_float, dumps
from .trainer import RunResult

__all__ = ["SCHEMA_VERSION", "BASELINE", "CompareReport", "render_table", "render_notes", "short_names",
           "memory_figure", "format_bytes", "ratio_text", "failed"]

SCHEMA_VERSION = 1
BASELINE = "fp32"          # the run that speed and memory ratios compare against


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """One workload trained under several recipes on one device, with the same seed and steps."""

    workload: str
    metric: str
    device: str
    device_name: str
    threads: int
    torch_version: str
    mixprec_version: str
    steps: int
    batch_size: int
    seed: int
    runs: tuple[RunResult, ...]
    tokens_per_sample: int = 0
    higher_is_better: bool = True
    synthetic: bool = False
    schema_version: int = SCHEMA_VERSION
    partial: bool = False      # interrupted (Ctrl-C): ``runs`` holds only the recipes that finished

    def run(self, label: str) -> RunResult:
        """The run whose label (recipe name) is ``label``."""
        for r in self.runs:
            if r.label == label:
                return r
        raise KeyError(f"no run labelled {label!r} in this report; it has {[r.label for r in self.runs]}")

    def to_json(self, indent: int | None = 2) -> str:
        """The report as strict JSON text (schema in the module docstring)."""
        data = dataclasses.asdict(self)
        return dumps(data, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> CompareReport:
        """Read a report written by ``to_json``; a wrong or newer schema is a ValueError saying so."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a mixprec report: invalid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError("not a mixprec report: the JSON is not an object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"report schema_version is {version!r}; this mixprec reads version "
                             f"{SCHEMA_VERSION}: read it with the mixprec that wrote it, or re-run compare")
        data = {"partial": False, **data}        # reports written before the field existed
        fields = _convert(data, _REPORT_FIELDS, "report")
        runs = data["runs"]
        if not isinstance(runs, list):
            raise ValueError("report field 'runs' must be a list of run objects")
        fields["runs"] = tuple(RunResult(**_convert(r, _RUN_FIELDS, f"runs[{i}]"))
                               for i, r in enumerate(runs))
        return cls(**fields)


# --------------------------------------------------------------------------------------- table
def render_table(report: CompareReport) -> Table:
    """The comparison as a rich Table: one row per recipe, a speedup column when fp32 ran."""
    baseline = next((r for r in report.runs if r.label == BASELINE), None)
    # No vertical rules and no edge padding: seven columns fit an 80-column log or pipe unwrapped.
    table = Table(title=f"{report.workload} on {report.device} ({report.device_name}): {report.steps} "
                        f"steps x batch {report.batch_size}, seed {report.seed}",
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
    """True when every step of ``run`` was skipped for inf/NaN gradients: the weights never moved."""
    return report.steps > 0 and run.skipped_steps >= report.steps


def memory_figure(run: RunResult) -> int:
    """The one memory number a table shows: the CUDA peak where measured, else the counted total."""
    return run.memory.peak if run.memory.peak is not None else run.memory.total


def format_bytes(n: float) -> str:
    """Bytes in decimal units (MB = 10**6 bytes, as the seeds count)."""
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
    notes += [f"{names[r.recipe]} FAILED: all {report.steps} steps were skipped for inf/NaN gradients, so "
              f"the weights never changed and its loss and {report.metric} are not results; "
              "'mixprec doctor' with this recipe, or MixedPrecision(..., trace_nonfinite=True), names the "
              "module and op where the first inf/NaN appeared" for r in report.runs if failed(report, r)]
    if report.partial:
        notes.append(f"PARTIAL: interrupted; only the {len(report.runs)} recipe(s) above finished")
    if report.synthetic:
        notes.append(f"note: {report.workload} trains on random data, for speed and memory; its "
                     f"{report.metric} only shows that the numbers stayed finite")
    if report.device.startswith("cpu"):
        notes.append("note: speed on CPU does not predict GPU tensor-core speed (16-bit matmuls are often "
                     "slower than fp32 on CPUs); the accuracy and memory figures still carry over")
    if any(r.memory.peak is None for r in report.runs):
        notes.append("loss: mean train loss over the last 10% of steps; memory: weights + gradients + "
                     "master copies + optimizer state + activations saved for backward, counted on the "
                     "first step; speed and mem: ratios to fp32")
    return notes


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


# ---------------------------------------------------------------------------------------- JSON
def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _floats(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of numbers, got {type(value).__name__}")
    return tuple(decode_float(v) for v in value)


def _memory(value: Any) -> MemoryBreakdown:
    names = [f.name for f in dataclasses.fields(MemoryBreakdown)]
    if not isinstance(value, dict) or set(value) != set(names):
        raise ValueError(f"expected an object with exactly {names}, got {value!r}")
    return MemoryBreakdown(**{k: (None if k == "peak" and value[k] is None else _int(value[k]))
                              for k in names})


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of integers, got {type(value).__name__}")
    return tuple(_int(v) for v in value)


# Field -> converter from its JSON value; the keys must match the dataclasses' fields exactly.
_REPORT_FIELDS: dict[str, Callable[[Any], Any]] = {
    "schema_version": _int, "workload": _str, "metric": _str, "device": _str, "device_name": _str,
    "threads": _int, "torch_version": _str, "mixprec_version": _str, "steps": _int, "batch_size": _int,
    "seed": _int, "tokens_per_sample": _int, "higher_is_better": _bool,
    "synthetic": _bool, "partial": _bool,
}
_RUN_FIELDS: dict[str, Callable[[Any], Any]] = {
    "recipe": _str, "label": _str, "final_loss": decode_float, "test_metric": decode_float,
    "samples_per_s": decode_float, "skipped_steps": _int, "final_scale": decode_float, "losses": _floats,
    "scales": _floats, "skipped_at": _ints, "wall_s": decode_float, "eval_steps": _ints,
    "eval_metrics": _floats, "memory": _memory,
}
assert set(_REPORT_FIELDS) | {"runs"} == {f.name for f in dataclasses.fields(CompareReport)}
assert set(_RUN_FIELDS) == {f.name for f in dataclasses.fields(RunResult)}


def _convert(data: Any, converters: dict[str, Callable[[Any], Any]], where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    expected = set(converters) | ({"runs"} if converters is _REPORT_FIELDS else set())
    missing, unknown = sorted(expected - data.keys()), sorted(data.keys() - expected)
    if missing or unknown:
        raise ValueError(f"{where} does not match schema version {SCHEMA_VERSION}: missing {missing}, "
                         f"unknown {unknown}")
    out = {}
    for key, convert in converters.items():
        try:
            out[key] = convert(data[key])
        except ValueError as e:
            raise ValueError(f"{where}.{key}: {e}") from None
    return out

"""DoctorReport: what ``mixprec doctor`` measured, its JSON form, its table and its findings.

JSON schema, version 1 (one object; strict JSON: non-finite floats are the strings ``"NaN"``,
``"Infinity"``, ``"-Infinity"``, as in compare's report)::

    schema_version   int      1
    kind             str      "doctor"
    workload, recipe, label, device, device_name, torch_version, mixprec_version   str
    steps, batch_size, seed   int     training steps run (statistics cover every one of them)
    losses           [float]  train loss at every step
    scales           [float]  loss scale after every step (1.0 without loss scaling)
    skipped_steps    int      steps skipped for inf/NaN gradients
    scaled           bool     whether the recipe scales the loss (false: flushed gradients are zeros)
    small_fraction   float    the scale window's "small gradients": all but this fraction must clear 2**-24
    margin           float    headroom kept between the largest gradient and fp16's max
    window           object   the loss-scale window for all gradients (see diagnostics.scale_window):
      low, high, recommended   int|null   exponents k of 2**k
      amax           float    largest gradient magnitude, true units
      below_floor_unscaled float  fraction of nonzero gradients below 2**-24 without loss scaling
    modules          list     per module, in model order:
      name, type     str      qualified name (model.named_modules()) and class
      stats          object   per kind present ("activations", "activation_grads", "weights",
                              "weight_grads", "updates"; gradients in true units):
        count, zeros, nonfinite   int
        amax         float    largest finite |x|
        exponents    [[k, n]] n nonzero finite values with floor(log2|x|) == k (k = -127 holds all
                              values below 2**-126)
        formats      object   per format ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"): counts of
                              zero, flush, subnormal, normal, overflow, nonfinite (exact; they sum to count)
      update_loss    object|null   updates, zeros int; lost {"fp16": int, "bf16": int}: nonzero
                              updates that would round away on weights held in that format
      window         object   this module's own loss-scale window (same fields as above); written
                              for readers, recomputed from stats when read back
    fp8_layers       list     fp8 recipes only (else []; absent in older files: read as []): per fp8
                              linear, in model order (diagnostics.fp8.fp8_layer_stats after the run):
      name           str;  out_features, in_features   int
      tensors        list     per role "input", "weight", "grad_output":
        role, format str      format "fp8_e4m3" or "fp8_e5m2"
        scale, amax  float    the last training cast's scale (x is cast as x * scale) and max |x|
        history_amax float|null   max of the amax history (delayed scaling), else null
        headroom_bits float   log2(F.max / (amax * scale)); < 0: the last cast saturated
        flush_below  float    |x| at or below this flushed to 0 at the last scale
        flushed_fraction, saturated_fraction   float|null   exact shares over every training cast of
                              the run (null if nothing was counted)
        counted      int      values counted
    fp8_swap         object|null   fp8 recipes only: the engine's swap report (mp.fp8_report):
      backend, note  str
      layers         list     every nn.Linear in module order: name str, out_features int,
                              in_features int, reason str (an Fp8Reason name: "SWAPPED", "SHAPE", ...),
                              detail str

Adding a field keeps the version (readers take a missing new field as empty); it is bumped when a
field changes meaning or goes away. ``DoctorReport.from_json(report.to_json()) == report``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from rich import box
from rich.table import Table

from ...diagnostics.fp8 import Fp8LayerStats, Fp8TensorStats
from ...diagnostics.range_stats import TensorStats
from ...diagnostics.ranges import ModuleRanges, UpdateLoss
from ...diagnostics.scale_window import ScaleWindow, below_floor, scale_window
from ...formats import RangeCounts
from ...fp8.swap import Fp8LayerDecision, Fp8Reason, Fp8SwapReport
from ...recipe import Precision, get_recipe
from ..strict_json import decode_float, dumps

__all__ = ["DOCTOR_SCHEMA_VERSION", "DoctorReport", "LayerRow", "layer_rows", "render_doctor_table",
           "render_findings", "pow2_text", "percent_text"]

DOCTOR_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """One doctor run: per-module ranges over ``steps`` steps of ``recipe``, and the scale window."""

    workload: str
    recipe: str
    label: str
    device: str
    device_name: str
    torch_version: str
    mixprec_version: str
    steps: int
    batch_size: int
    seed: int
    losses: tuple[float, ...]
    scales: tuple[float, ...]
    skipped_steps: int
    scaled: bool
    small_fraction: float
    margin: float
    modules: tuple[ModuleRanges, ...]
    window: ScaleWindow
    fp8_layers: tuple[Fp8LayerStats, ...] = ()    # fp8 recipes: per fp8 linear, after the run
    fp8_swap: Fp8SwapReport | None = None          # fp8 recipes: which linears were swapped, why not
    schema_version: int = DOCTOR_SCHEMA_VERSION

    @property
    def final_scale(self) -> float:
        """The loss scale the run ended with (1.0 without loss scaling)."""
        return self.scales[-1] if self.scales else 1.0

    def module_window(self, module: ModuleRanges) -> ScaleWindow:
        """The loss-scale window of one module's gradients alone."""
        return scale_window(module.gradients(), self.small_fraction, self.margin)

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON text (schema in the module docstring)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("modules", "window", "fp8_layers", "fp8_swap")}
        data = {"schema_version": self.schema_version, "kind": "doctor", **data}
        data["window"] = _window_json(self.window)
        data["modules"] = [{"name": m.name, "type": m.type,
                            "stats": {k: _stats_json(s) for k, s in m.stats.items()},
                            "update_loss": dataclasses.asdict(m.update_loss) if m.update_loss else None,
                            "window": _window_json(self.module_window(m))} for m in self.modules]
        data["fp8_layers"] = _fp8_stats_json(self.fp8_layers)
        data["fp8_swap"] = _fp8_swap_json(self.fp8_swap)
        return dumps(data, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> DoctorReport:
        """Read ``to_json``'s text back; a wrong schema is a ValueError that names the field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a mixprec doctor report: invalid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("kind") != "doctor":
            raise ValueError("not a mixprec doctor report (no \"kind\": \"doctor\")")
        if data.get("schema_version") != DOCTOR_SCHEMA_VERSION:
            raise ValueError(f"doctor report schema_version is {data.get('schema_version')!r}; this mixprec "
                             f"reads version {DOCTOR_SCHEMA_VERSION}")
        try:
            # fp8_layers/fp8_swap came later within version 1: absent means a report without them.
            fields = {f.name: data[f.name] for f in dataclasses.fields(cls)
                      if f.name not in ("fp8_layers", "fp8_swap")}
            fields["fp8_layers"] = _fp8_stats_from(data.get("fp8_layers", []))
            fields["fp8_swap"] = _fp8_swap_from(data.get("fp8_swap"))
            fields["losses"] = tuple(decode_float(v) for v in fields["losses"])
            fields["scales"] = tuple(decode_float(v) for v in fields["scales"])
            fields["small_fraction"] = decode_float(data["small_fraction"])
            fields["margin"] = decode_float(data["margin"])
            fields["window"] = _window_from(data["window"])
            fields["modules"] = tuple(_module_from(m) for m in data["modules"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"doctor report does not match schema version {DOCTOR_SCHEMA_VERSION}: "
                             f"{type(e).__name__} {e}") from None
        return cls(**fields)


# ----------------------------------------------------------------------------------- JSON helpers
def _stats_json(s: TensorStats) -> dict[str, Any]:
    return {"count": s.count, "zeros": s.zeros, "nonfinite": s.nonfinite, "amax": s.amax,
            "exponents": [list(p) for p in s.exponents],
            "formats": {name: dataclasses.asdict(c) for name, c in s.formats.items()}}


def _stats_from(d: dict[str, Any]) -> TensorStats:
    return TensorStats(count=int(d["count"]), zeros=int(d["zeros"]), nonfinite=int(d["nonfinite"]),
                       amax=decode_float(d["amax"]), exponents=tuple((int(k), int(n)) for k, n in d["exponents"]),
                       formats={name: RangeCounts(**c) for name, c in d["formats"].items()})


def _window_json(w: ScaleWindow) -> dict[str, Any]:
    return {"low": w.low, "high": w.high, "recommended": w.recommended, "amax": w.amax,
            "below_floor_unscaled": w.below_floor_unscaled}


def _window_from(d: dict[str, Any]) -> ScaleWindow:
    return ScaleWindow(d["low"], d["high"], decode_float(d["amax"]), decode_float(d["below_floor_unscaled"]))


def _module_from(d: dict[str, Any]) -> ModuleRanges:
    loss = d["update_loss"]
    return ModuleRanges(name=d["name"], type=d["type"],
                        stats={k: _stats_from(s) for k, s in d["stats"].items()},
                        update_loss=UpdateLoss(**loss) if loss is not None else None)


def _fp8_stats_json(layers: tuple[Fp8LayerStats, ...]) -> list[dict[str, Any]]:
    """Plain data for ``fp8_layers`` (floats stay floats; strict_json encodes inf/NaN)."""
    return [{"name": s.name, "out_features": s.out_features, "in_features": s.in_features,
             "tensors": [{"role": t.role, "format": t.format, "scale": t.scale, "amax": t.amax,
                          "history_amax": t.history_amax, "headroom_bits": t.headroom_bits,
                          "flush_below": t.flush_below, "flushed_fraction": t.flushed_fraction,
                          "saturated_fraction": t.saturated_fraction, "counted": t.counted}
                         for t in s.tensors]} for s in layers]


def _opt_float(v: Any) -> float | None:
    return None if v is None else decode_float(v)


def _fp8_stats_from(data: list[dict[str, Any]]) -> tuple[Fp8LayerStats, ...]:
    """``_fp8_stats_json``'s data back as typed stats; a missing key is a KeyError for the caller."""
    return tuple(Fp8LayerStats(
        name=s["name"], out_features=int(s["out_features"]), in_features=int(s["in_features"]),
        tensors=tuple(Fp8TensorStats(
            role=t["role"], format=t["format"], scale=decode_float(t["scale"]), amax=decode_float(t["amax"]),
            history_amax=_opt_float(t["history_amax"]), headroom_bits=decode_float(t["headroom_bits"]),
            flush_below=decode_float(t["flush_below"]), flushed_fraction=_opt_float(t["flushed_fraction"]),
            saturated_fraction=_opt_float(t["saturated_fraction"]), counted=int(t["counted"]))
            for t in s["tensors"])) for s in data)


def _fp8_swap_json(swap: Fp8SwapReport | None) -> dict[str, Any] | None:
    """The swap report as plain data; reasons by enum name (``"SHAPE"``), stable across wordings."""
    if swap is None:
        return None
    return {"backend": swap.backend, "note": swap.note,
            "layers": [{"name": d.name, "out_features": d.out_features, "in_features": d.in_features,
                        "reason": d.reason.name, "detail": d.detail} for d in swap.layers]}


def _fp8_swap_from(data: dict[str, Any] | None) -> Fp8SwapReport | None:
    """``_fp8_swap_json``'s data back; an unknown reason name is a KeyError for the caller."""
    if data is None:
        return None
    return Fp8SwapReport(
        layers=tuple(Fp8LayerDecision(d["name"], int(d["out_features"]), int(d["in_features"]),
                                      Fp8Reason[d["reason"]], d["detail"]) for d in data["layers"]),
        backend=data["backend"], note=data["note"])


# ----------------------------------------------------------------------------------- the table
def pow2_text(k: int | None) -> str:
    return "-" if k is None else f"2^{k}"


def percent_text(fraction: float | None) -> str:
    """A fraction as a percentage with enough digits to tell 0 from tiny."""
    if fraction is None:
        return "-"
    if fraction == 0:
        return "0"
    pct = 100 * fraction
    return f"{pct:.1f}%" if pct >= 0.1 else f"{pct:.2g}%"


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One module's line in the doctor table (fractions; None where the module has no such tensors)."""

    name: str
    type: str
    underflow: float | None      # nonzero gradients below 2**-24 with no loss scale
    underflow_run: float | None  # ... at the run's final loss scale
    overflow: float | None       # activations that are, or would become, inf in fp16
    act_amax: float | None
    grad_amax: float | None
    lost_fp16: float | None      # nonzero updates lost on fp16 weights
    lost_bf16: float | None
    window: ScaleWindow

    @property
    def severity(self) -> float:
        return max(self.underflow or 0.0, self.overflow or 0.0, self.lost_fp16 or 0.0)


def layer_rows(report: DoctorReport) -> list[LayerRow]:
    """One row per module, worst first (the largest of its underflow, overflow and update loss)."""
    k_run = _exp_of(report.final_scale)
    rows = []
    for m in report.modules:
        grads, acts = m.gradients(), m.stats.get("activations")
        overflow = None
        if acts is not None and acts.count:
            fp16 = acts.formats["fp16"]
            overflow = (fp16.overflow + fp16.nonfinite) / acts.count
        rows.append(LayerRow(
            name=m.name, type=m.type,
            underflow=below_floor(grads, 0) if grads else None,
            underflow_run=below_floor(grads, k_run) if grads and k_run is not None else None,
            overflow=overflow, act_amax=acts.amax if acts else None, grad_amax=grads.amax if grads else None,
            lost_fp16=m.update_loss.fraction("fp16") if m.update_loss else None,
            lost_bf16=m.update_loss.fraction("bf16") if m.update_loss else None,
            window=report.module_window(m)))
    return sorted(rows, key=lambda r: -r.severity)   # stable: ties keep model order


def _exp_of(scale: float) -> int | None:
    """log2 of a power-of-two scale, None for any other (the bins only shift by whole powers)."""
    if scale > 0 and math.isfinite(scale):
        k = math.log2(scale)
        if k.is_integer():
            return int(k)
    return None


def render_doctor_table(report: DoctorReport) -> Table:
    """The per-layer table: worst first, fractions as percentages, scales as powers of two."""
    table = Table(title=f"{report.workload} under {report.label} on {report.device}: ranges over "
                        f"{report.steps} steps (gradients in true units)",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    k_run = _exp_of(report.final_scale)
    run_scale = pow2_text(k_run) if k_run is not None else f"{report.final_scale:g}"
    # Narrow headers, no type column: the table fits an 80-column log for short module names.
    for header in ("module", "grad<2^-24", f"@{run_scale}", "act ovf", "grad max", "lost fp16", "bf16",
                   "window", "rec"):
        table.add_column(header, justify="left" if header == "module" else "right", no_wrap=True)
    for r in layer_rows(report):
        w = r.window
        table.add_row(r.name or "(model)", percent_text(r.underflow), percent_text(r.underflow_run),
                      percent_text(r.overflow), _num(r.grad_amax), percent_text(r.lost_fp16),
                      percent_text(r.lost_bf16), f"{w.low}..{w.high}" if w.low is not None else "-",
                      pow2_text(w.recommended))
    return table


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def render_findings(report: DoctorReport) -> list[str]:
    """A few plain sentences: what underflows, the scale to use, lost updates, overflows."""
    rows = layer_rows(report)
    w = report.window
    out = []
    worst = max((r for r in rows if r.underflow is not None), key=lambda r: r.underflow, default=None)
    out.append(f"gradients: {percent_text(w.below_floor_unscaled)} of the nonzero gradient values lie "
               f"below fp16's smallest subnormal (2^-24) in true units; without loss scaling fp16 flushes "
               f"them to zero or rounds them to 2^-24"
               + (f" (worst: module {worst.name!r}, {percent_text(worst.underflow)})" if worst and worst.underflow
                  else ""))
    # Only fp16 compute flushes small gradients to zero in the backward (bf16/fp8 recipes keep fp32's range).
    fp16_unscaled = not report.scaled and get_recipe(report.recipe).compute is Precision.FP16
    dead = [m.name for m in report.modules
            if (g := m.gradients()) is not None and g.count and g.zeros == g.count]
    if dead:
        out.append(f"every gradient value of module{'s' if len(dead) > 1 else ''} "
                   f"{', '.join(repr(n) for n in dead)} was exactly zero"
                   + (": without a loss scale, that is what fp16's flush looks like" if fp16_unscaled else ""))
    if w.low is None:
        out.append("loss scale: no nonzero finite gradients were seen; nothing to recommend")
    elif w.fits:
        out.append(f"loss scale: powers of two from {pow2_text(w.low)} to {pow2_text(w.high)} keep all but "
                   f"{percent_text(report.small_fraction)} of the gradients at or above 2^-24 and the "
                   f"largest ({w.amax:.3g}) {report.margin:g}x below fp16's max; recommended "
                   f"{pow2_text(w.recommended)}")
    else:
        out.append(f"loss scale: no power of two fits: lifting the small gradients needs "
                   f"{pow2_text(w.low)} but the largest ({w.amax:.3g}) allows at most {pow2_text(w.high)}: "
                   "the gradients span more than fp16's range; use bf16 (fp32's exponent range)")
    k_run = _exp_of(report.final_scale)
    if report.scaled and w.low is not None:
        where = ("inside the window" if k_run is not None and w.fits and w.low <= k_run <= w.high
                 else "above the window (overflow risk: it skips steps and backs off)"
                 if k_run is not None and k_run > w.high
                 else "below the window (small gradients still flush)")
        share = below_floor(_all_grads(report), k_run) if k_run is not None else None
        at_run = "" if share is None else \
            f"; at that scale {percent_text(share) if share else 'none'} of the gradients stay below 2^-24"
        out.append(f"the run's loss scaler ended at {report.final_scale:g} after {report.steps} steps "
                   f"({report.skipped_steps} skipped): {where}{at_run}")
    elif fp16_unscaled:
        out.append("this recipe does not scale the loss: gradients that fp16 flushed during backward were "
                   "counted as zeros, not as small values; run the doctor with scale=dynamic (the default "
                   "fp16 recipe) or fp32 to see their true sizes")
    lost = [r for r in rows if r.lost_fp16]
    if lost:
        top = max(lost, key=lambda r: r.lost_fp16)
        bf16 = max((r.lost_bf16 or 0.0) for r in rows)
        out.append(f"updates: on fp16 weights up to {percent_text(top.lost_fp16)} of a layer's nonzero "
                   f"updates would round away (module {top.name!r}); on bf16 weights up to {percent_text(bf16)}: "
                   "keep fp32 master weights (fp16-pure, bf16-pure) or stochastic rounding (bf16-sr)")
    over = [r for r in rows if r.overflow]
    if over:
        top = max(over, key=lambda r: r.overflow)
        out.append(f"overflow: {percent_text(top.overflow)} of module {top.name!r}'s activations exceed fp16's max "
                   "(65504); keep that module in fp32 or use bf16")
    return out


def _all_grads(report: DoctorReport) -> TensorStats:
    merged = TensorStats.merge([g for g in (m.gradients() for m in report.modules) if g is not None])
    assert merged is not None
    return merged

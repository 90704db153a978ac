"""DoctorReport: what ``mixprec doctor`` measured, its JSON form, its table and its findings.

JSON schema, version 1 (one object; strict JSON: non-finite floats are the strings ``"NaN"``,
``"Infinity"``, ``"-Infinity"``, as in compare's report)::

    schema_version   int      1
    kind             str      "doctor"
    workload, recipe, label, device, device_name, torch_version, mixprec_version   str
    steps, batch_size, seed   int     training steps run (statistics cover every one of them)
    losses           [float]  train loss at every step
    scales           [float]  loss scale after every step (1.0 without loss scaling)
    skipped_steps    int      steps skipped for an inf/NaN gradient norm (docs/step.md)
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
                              linear, in model order (fp8.stats.fp8_layer_stats after the run):
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
      layers         list     every nn.Linear and expert projection in module order: name str,
                              out_features int, in_features int, reason str (an Fp8Reason name:
                              "SWAPPED", "SHAPE", ...), detail str, groups int (experts; 1 for a linear)
      uncovered      list     every other weight of 2+ dims (never fp8): name str, shape list of int,
                              reason str (e.g. a mixture of experts' 3-D expert weights)
      parameters     int      the model's parameter count (0 in files written before it was added)
    what_if          object|null   ``doctor --what-if`` only (absent in older files: read as null):
                              per linear layer, what each fp8/fp4 format would do (what_if_report.py):
      floor_db       float    the SQNR floor of the advice;  max_rows int  rows of x and g kept per layer
      step           int      the training step whose x, W, g were captured;  seconds float  its cost
      layers         list     per nn.Linear / HF Conv1D, in model order:
        name, type   str;  in_features, out_features, rows, rows_total   int (rows measured of those seen)
        advice       str      the cheapest tolerated format or "bf16"; written for readers, recomputed
        formats      list     per format ("fp8", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"):
          format     str;  bits float   bits per element, scales included
          sqnr_out_db, sqnr_grad_w_db   float   against the bf16 GEMM; "Infinity" when identical
          counts     object   per role "input", "weight", "grad_output": [flushed, saturated, values]
          grad_snr, grad_sign   float   end-to-end weight-gradient SNR and sign agreement against fp32,
                              the whole model in the format (grad_snr.py); "NaN" when not measured

Adding a field keeps the version (``SCHEMA.added``: readers take a missing new field as empty); it is
bumped when a field changes meaning or goes away. ``DoctorReport.from_json(report.to_json()) == report``;
the JSON comes from the lab's one codec (``lab/codec.py``), driven by the dataclasses' fields.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...fp8.stats import Fp8LayerStats
from ...diagnostics.range_collector import ModuleRanges
from ...diagnostics.scale_window import ScaleWindow, scale_window
from ...fp8.swap_report import Fp8SwapReport
from ..codec import JsonReport, Schema, attr
from .what_if_report import LayerWhatIf, WhatIfReport

__all__ = ["DoctorReport"]


@dataclasses.dataclass(frozen=True)
class DoctorReport(JsonReport):
    """One doctor run: per-module ranges over ``steps`` steps of ``recipe``, and the scale window."""

    SCHEMA: ClassVar[Schema] = Schema(
        "doctor", 1, added=frozenset({"fp8_layers", "fp8_swap", "fp8_swap.uncovered", "fp8_swap.parameters",
                                      "fp8_swap.layers[].groups",
                                      "what_if", "what_if.layers[].formats[].grad_snr",
                                      "what_if.layers[].formats[].grad_sign"}),
        # Written for readers of the file, recomputed from the fields when read back:
        derived={ScaleWindow: {"recommended": attr("recommended")},
                 ModuleRanges: {"window": lambda report, module: report.module_window(module)},
                 LayerWhatIf: {"advice": lambda report, layer: report.what_if.advice(layer)}})

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
    what_if: WhatIfReport | None = None             # --what-if: per linear layer and fp8/fp4 format

    @property
    def final_scale(self) -> float:
        """The loss scale the run ended with (1.0 without loss scaling)."""
        return self.scales[-1] if self.scales else 1.0

    def module_window(self, module: ModuleRanges) -> ScaleWindow:
        """The loss-scale window of one module's gradients alone."""
        return scale_window(module.gradients(), self.small_fraction, self.margin)

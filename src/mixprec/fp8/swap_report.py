"""The fp8 swap's report: every decision it made, typed, and why a layer stayed in the base recipe.

``swap_to_fp8`` (swap.py) decides, for each ``nn.Linear`` (and Hugging Face ``Conv1D``, and each
projection of a mixture of experts' grouped GEMMs), whether it becomes fp8; this module holds what it
answers with. ``Fp8Reason`` is why (swapped, forced, or the rule that kept it out), ``Fp8LayerDecision``
one layer's line (name, weight shape ``(out, in)``, reason, detail), ``Fp8UncoveredWeight`` a weight of
2+ dimensions outside every linear layer (an embedding, a convolution, a router), and
``Fp8SwapReport`` all of them with the backend, printed one line per layer (here an embedding and two
linears, ``nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))``)::

    fp8: 1 of 2 linear layers swapped (34% of the parameters), backend emulate
      layer     weight (out, in)  decision
      1                 (64, 32)  fp8
      3                 (10, 64)  weight dims not multiples of 16: pad to (16, 64)
      not covered: 1 weight outside linear layers (54% of the parameters)
      0.weight         (100, 32)  an embedding: a lookup, no matmul

``none_swapped_reason`` is the engine's warning when an fp8 recipe swapped nothing. The lab's report
codec stores these dataclasses in doctor.json (``lab/doctor/report.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import math

__all__ = ["Fp8Reason", "Fp8LayerDecision", "Fp8UncoveredWeight", "Fp8SwapReport", "none_swapped_reason",
           "FORMAT_WORDS"]

# How a swapped layer's line names a blocked format (per-tensor fp8 lines keep the bare "fp8").
FORMAT_WORDS = {"current": "current e4m3/e5m2, one scale per tensor",
                "delayed": "delayed e4m3/e5m2, one scale per tensor from an amax history",
                "rowwise": "rowwise e4m3, a power-of-two scale per row",
                "block": "block e4m3, 1x128 tiles and 128x128 weight blocks",
                "mxfp8": "mxfp8 e4m3, e8m0 scale per 32",
                "nvfp4": "nvfp4 e2m1, e4m3 scale per 16 x fp32"}


class Fp8Reason(enum.Enum):
    """Why a linear layer was, or was not, swapped for fp8."""

    SWAPPED = "fp8"
    FORCED = "fp8 (forced)"
    SHAPE = "weight dims not multiples of 16"
    SKIP = "matches a skip pattern"
    FIRST = "first linear (skip_first)"
    LAST = "last linear (skip_last)"
    FILTER = "the fp8 filter returned False"
    SUBCLASS = "a subclass of nn.Linear (its own forward)"
    FP32 = "kept fp32 by fp32_modules"
    ROOT = "the model itself is the linear (wrap it in a module)"
    SCALING = "grouped expert GEMMs take per-tensor scaling only"
    EXPERTS = "these experts cannot run in fp8"


@dataclasses.dataclass(frozen=True)
class Fp8LayerDecision:
    """One linear layer, or one projection of a mixture of experts (``groups`` experts, each with a
    weight ``(out, in)``): its qualified name, weight shape ``(out, in)``, and what happened to it."""

    name: str
    out_features: int
    in_features: int
    reason: Fp8Reason
    detail: str = ""     # e.g. the skip pattern that matched
    groups: int = 1      # experts sharing this projection's grouped GEMM; 1 for a linear layer

    @property
    def swapped(self) -> bool:
        return self.reason in (Fp8Reason.SWAPPED, Fp8Reason.FORCED)


@dataclasses.dataclass(frozen=True)
class Fp8UncoveredWeight:
    """A weight outside every linear layer (so never fp8): qualified name, shape, and why."""

    name: str
    shape: tuple[int, ...]
    reason: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Fp8SwapReport:
    """Every ``nn.Linear`` of a model, in module order, with the swap decision; plus the backend, the
    weights outside linear layers (``uncovered``) and the model's parameter count."""

    layers: tuple[Fp8LayerDecision, ...]
    backend: str            # "scaled_mm" or "emulate"
    note: str = ""          # how the backend was chosen, when auto chose it by a probe
    uncovered: tuple[Fp8UncoveredWeight, ...] = ()   # 2-D and larger weights no linear layer holds
    parameters: int = 0     # the model's parameter count (shared ones once)

    @property
    def swapped(self) -> tuple[str, ...]:
        """Qualified names of the layers now computing in fp8."""
        return tuple(d.name for d in self.layers if d.swapped)

    @property
    def fp8_fraction(self) -> float:
        """The share of the model's parameters held by fp8 layers' weights (0 for an empty model)."""
        fp8 = sum(d.groups * d.out_features * d.in_features for d in self.layers if d.swapped)
        return fp8 / self.parameters if self.parameters else 0.0

    @property
    def kinds(self) -> str:
        """What the decisions are about, for the summary line."""
        grouped = any(d.groups > 1 for d in self.layers)
        return "linear layers and grouped expert GEMMs" if grouped else "linear layers"

    @property
    def not_swapped(self) -> dict[str, Fp8Reason]:
        """The other linears and why each stayed in the base recipe."""
        return {d.name: d.reason for d in self.layers if not d.swapped}

    def __str__(self) -> str:
        width = max([len("layer")] + [len(d.name) for d in self.layers] + [len(u.name) for u in self.uncovered])
        share = f" ({self.fp8_fraction:.0%} of the parameters)" if self.parameters else ""
        # A blocked format's name leads the swapped layers' detail (see swap_to_fp8 in swap.py).
        words = dict.fromkeys(d.detail.split()[0] for d in self.layers
                              if d.swapped and d.detail and d.detail.split()[0] in FORMAT_WORDS)
        kind = (" to " + "+".join(words)) if words else ""
        lines = [f"fp8: {len(self.swapped)} of {len(self.layers)} {self.kinds} swapped{kind}{share}, backend "
                 f"{self.backend}"] + ([f"  {self.note}"] if self.note else []) + \
                [f"  {'layer':<{width}}  {'weight (out, in)':>16}  decision"]
        for d in self.layers:
            shape = (f"{d.groups} x " if d.groups > 1 else "") + f"({d.out_features}, {d.in_features})"
            why = d.reason.value + (f": {d.detail}" if d.detail else "")
            lines.append(f"  {d.name:<{width}}  {shape:>16}  {why}")
        if self.uncovered:
            share = f" ({sum(u.numel for u in self.uncovered) / self.parameters:.0%} of the parameters)" \
                if self.parameters else ""
            n = len(self.uncovered)
            lines.append(f"  not covered: {n} weight{'s' if n > 1 else ''} outside linear layers{share}")
            for u in self.uncovered:
                lines.append(f"  {u.name:<{width}}  {str(u.shape):>16}  {u.reason}")
        return "\n".join(lines)


def none_swapped_reason(report: Fp8SwapReport, label: str) -> str | None:
    """Why an fp8 recipe swapped no layer (the text of the engine's warning), or None if one was swapped.

    With no layer swapped the recipe trains exactly as its base recipe: nothing runs in fp8.
    """
    if report.swapped:
        return None
    if not report.layers:
        why = "the model has no nn.Linear (nor Hugging Face Conv1D) layer"
    else:
        shown = "; ".join(f"{d.name or '<the model>'} ({d.out_features}, {d.in_features}): {d.reason.value}"
                          + (f": {d.detail}" if d.detail else "") for d in report.layers[:6])
        more = f"; and {len(report.layers) - 6} more" if len(report.layers) > 6 else ""
        why = f"none of its {len(report.layers)} linear layers is eligible: {shown}{more}"
    return (f"recipe {label!r} swapped no layer to fp8 ({why}), so nothing runs in fp8 and it trains as its "
            "base recipe. Make the layers eligible (weight dimensions multiples of 16, plain nn.Linear, not "
            "excluded by skip=/skip_first/skip_last/fp8_filter) or pick a recipe without fp8 (e.g. 'bf16'); "
            "mp.fp8_report lists every decision")

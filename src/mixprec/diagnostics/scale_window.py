"""Which loss scales suit a set of gradients: the window of powers of two that fits them into fp16.

Multiplying the loss by ``S = 2**k`` multiplies every gradient by ``S`` exactly (a power of two only
moves the exponent), so a gradient histogram by ``floor(log2|g|)`` simply shifts right by ``k`` bins.
Two conditions bound ``k``:

- **lift the small gradients**: at most ``SMALL_FRACTION`` (1%) of the nonzero gradients may stay below
  fp16's smallest subnormal, ``2**-24``, where they flush to zero or round to it. "Small" is thus the
  1st percentile of ``|g|``: the mixed-precision paper found ~5% of an SSD detector's gradients below
  ``2**-24``, and a tail that thin is where loss scaling earns its keep. Smallest such ``k``: ``low``.
- **keep the largest below fp16's max with a margin**: ``amax * 2**k * MARGIN <= 65504``, with
  ``MARGIN = 8`` (three binades): the largest gradient seen over a few steps is not the largest the
  run will see, and the dynamic scaler itself only learns of an overflow by skipping a step. Largest
  such ``k``: ``high``.

The recommendation is ``2**high``, the top of the window (the most lift the margin allows): small
gradients keep the most precision there. ``low > high`` means no single scale fits: the gradients
span more binades than fp16 offers (use bf16, or per-layer scaling)::

    w = scale_window(stats)       # stats: a TensorStats of gradients in true units
    w.low, w.high, w.recommended  # exponents k of 2**k
"""

from __future__ import annotations

import dataclasses
import math

from ..formats import FP16
from .range_histogram import TensorStats

__all__ = ["MARGIN", "SMALL_FRACTION", "ScaleWindow", "below_floor", "scale_window"]

SMALL_FRACTION = 0.01       # gradients allowed to stay below fp16's subnormal floor
MARGIN = 8.0                # headroom kept under fp16's max for the largest gradient
_FLOOR_EXP = -24            # log2 of FP16.min_subnormal
assert FP16.min_subnormal == 2.0**_FLOOR_EXP


@dataclasses.dataclass(frozen=True)
class ScaleWindow:
    """The powers of two ``2**low .. 2**high`` that fit the gradients into fp16 (exponents).

    ``low``/``high`` are None when there were no nonzero finite gradients; ``recommended`` is
    ``high`` when ``low <= high``, else None. ``below_floor_unscaled`` is the fraction of nonzero
    gradients below ``2**-24`` without a loss scale (:func:`below_floor` gives it at any scale).
    """

    low: int | None
    high: int | None
    amax: float
    below_floor_unscaled: float      # fraction of nonzero gradients below 2**-24 with no loss scale

    @property
    def recommended(self) -> int | None:
        if self.low is None or self.high is None or self.low > self.high:
            return None
        return self.high

    @property
    def fits(self) -> bool:
        """True when some power of two satisfies both conditions."""
        return self.recommended is not None


def below_floor(stats: TensorStats, k: int) -> float:
    """Fraction of ``stats``' nonzero finite values below ``2**-24`` once multiplied by ``2**k``.

    ``|g| * 2**k < 2**-24`` exactly when ``floor(log2|g|) < -24 - k``: read straight off the bins.
    """
    return stats.fraction_below(_FLOOR_EXP - k)


def scale_window(stats: TensorStats | None, small_fraction: float = SMALL_FRACTION,
                 margin: float = MARGIN) -> ScaleWindow:
    """The loss-scale window for gradients summarised by ``stats`` (true units; see module docstring)."""
    if not 0.0 <= small_fraction < 1.0:
        raise ValueError(f"small_fraction must be in [0, 1), got {small_fraction}")
    if not margin >= 1.0:
        raise ValueError(f"margin must be >= 1, got {margin}")
    if stats is None or stats.count - stats.zeros - stats.nonfinite == 0:
        return ScaleWindow(None, None, 0.0 if stats is None else stats.amax, 0.0)
    exps = [k for k, _ in stats.exponents]
    # below_floor(k) falls as k grows and is 0 once k lifts the smallest bin to the floor: start there
    # and step down while the condition still holds.
    k = _FLOOR_EXP - min(exps)                   # lifts everything: below_floor == 0
    while below_floor(stats, k - 1) <= small_fraction:   # ends: once every bin is below, it is 1.0
        k -= 1
    low = k
    # amax * 2**k * margin <= max  <=>  k <= log2(max / (margin * amax)); floor for the largest k.
    high = math.floor(math.log2(FP16.max / (margin * stats.amax)))
    return ScaleWindow(low, high, stats.amax, below_floor(stats, 0))

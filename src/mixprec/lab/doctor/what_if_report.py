"""The doctor's what-if, as it is reported: per linear layer and low-precision format, what was measured
(``what_if.py`` measures it), and the advice read from it.

``WhatIfReport`` holds one ``LayerWhatIf`` per captured linear layer, in model order, and each holds one
``FormatWhatIf`` per format (``FORMATS``: the named recipes ``fp8``, ``fp8-rowwise``, ``fp8-block``,
``mxfp8``, ``nvfp4``): its bits per element, the SQNR of the output and of the weight gradient against
bf16, and per operand the values flushed to zero and saturated; the end-to-end gradient SNR when
``grad_snr.py`` filled it in. A format is *tolerated* when both SQNRs reach the floor (``floor_db``,
20 dB by default), it saturates nothing, and its gradient SNR (when measured) reaches
``GRAD_SNR_FLOOR``; the advice per layer is the cheapest tolerated format, ``bf16`` when none is::

    >>> fmt = FormatWhatIf("fp8", bits=8.0, sqnr_out_db=28.5, sqnr_grad_w_db=25.0,
    ...                    counts={"input": (0, 0, 64), "weight": (0, 0, 64), "grad_output": (2, 0, 64)})
    >>> fmt.tolerated(DEFAULT_FLOOR_DB), fmt.flushed("grad_output"), fmt.tolerated(26.0)
    (True, 0.03125, False)

``WhatIfOptions`` is what the doctor is asked to measure (``--what-if-floor``, ``--what-if-rows``).
The doctor's report stores these dataclasses in doctor.json (``report.py``).
"""

from __future__ import annotations

import dataclasses
import math

from ...fp8.swap import shape_takes_fp8

__all__ = ["FORMATS", "DEFAULT_FLOOR_DB", "GRAD_SNR_FLOOR", "DEFAULT_MAX_ROWS", "ROW_UNIT", "WhatIfOptions",
           "FormatWhatIf", "LayerWhatIf", "WhatIfReport"]

FORMATS = ("fp8", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4")   # named recipes, per-tensor first
# The floor, in dB, that both SQNRs must reach: 20 dB, an error carrying 1% of the signal's energy. On
# normal data per-tensor fp8 gives ~28.5 dB on the output (e4m3 x e4m3) and ~25 dB on the weight gradient
# (e5m2 gradients), the blocked fp8 formats ~28.5 dB on both, nvfp4 ~16 dB (tests/test_doctor_what_if.py's
# plain layer). So the floor passes every fp8 format on a well-behaved layer with 5 dB to spare, fails a
# format that loses 5+ dB more to a layer's outliers, and stops nvfp4 on normal data; the heavier-tailed
# activations of real models give nvfp4 more (the lab's gpt: 22-30 dB), and it passes there.
DEFAULT_FLOOR_DB = 20.0
GRAD_SNR_FLOOR = math.sqrt(3)   # end-to-end gradient SNR below which quantization outweighs the gradient
DEFAULT_MAX_ROWS = 4096     # rows of x and g per layer: 4 sequences of 1024, 32 of 128
ROW_UNIT = 128              # rows are kept in whole 128-blocks (the largest block along M)


@dataclasses.dataclass(frozen=True)
class WhatIfOptions:
    """What the doctor's what-if measures: the SQNR floor of its advice, the rows kept per layer."""

    floor_db: float = DEFAULT_FLOOR_DB
    max_rows: int = DEFAULT_MAX_ROWS
    grad_snr: bool = True       # also the end-to-end gradient SNR per layer and format (grad_snr.py)

    def __post_init__(self) -> None:
        if isinstance(self.floor_db, bool) or not isinstance(self.floor_db, (int, float)) \
                or not math.isfinite(self.floor_db) or self.floor_db < 0:
            raise ValueError(f"--what-if-floor must be a finite number of dB >= 0 (e.g. 20; below 0 dB the "
                             f"error is larger than the signal and every format passes), got {self.floor_db!r}")
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < ROW_UNIT:
            raise ValueError(f"--what-if-rows must be an integer >= {ROW_UNIT} (rows of x and g kept per "
                             f"layer), got {self.max_rows!r}")


# ------------------------------------------------------------------------------------ results
@dataclasses.dataclass(frozen=True)
class FormatWhatIf:
    """One layer under one format: both SQNRs, its storage cost, and per operand the range counts."""

    format: str                               # a FORMATS name
    bits: float                               # bits per element, scales included (mean over x, W, g)
    sqnr_out_db: float                        # y = x W^T against bf16; inf: identical; NaN: inf/NaN seen
    sqnr_grad_w_db: float                     # grad_W = g^T x against bf16
    counts: dict[str, tuple[int, int, int]]   # per role ("input", "weight", "grad_output"):
                                              # (flushed nonzero values, saturated values, values)
    grad_snr: float = math.nan                # end-to-end: |g| / |g_f - g|, the whole model in the format
    grad_sign: float = math.nan               # |g|-weighted sign agreement with fp32's gradient (grad_snr.py)

    def flushed(self, role: str | None = None) -> float:
        """Share of ``role``'s values flushed to zero; the largest over the three roles when None."""
        return self._share(0, role)

    def saturated(self, role: str | None = None) -> float:
        """Share of ``role``'s values clipped at the element max; the largest of the three when None."""
        return self._share(1, role)

    def _share(self, i: int, role: str | None) -> float:
        roles = list(self.counts) if role is None else [role]
        return max((self.counts[r][i] / self.counts[r][2] if self.counts[r][2] else 0.0) for r in roles)

    @property
    def sqnr_min_db(self) -> float:
        """The lower of the two SQNRs (NaN if either is NaN): what the advice compares with the floor."""
        a, b = self.sqnr_out_db, self.sqnr_grad_w_db
        return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)

    def tolerated(self, floor_db: float) -> bool:
        """Both SQNRs at or above ``floor_db``, nothing saturated, and the end-to-end gradient SNR (when
        measured) at or above ``GRAD_SNR_FLOOR``."""
        return (self.sqnr_min_db >= floor_db and all(c[1] == 0 for c in self.counts.values())
                and not self.grad_snr < GRAD_SNR_FLOOR)


@dataclasses.dataclass(frozen=True)
class LayerWhatIf:
    """One linear layer: its shape, the rows measured, and each format's result (FORMATS order)."""

    name: str
    type: str
    in_features: int                  # K
    out_features: int                 # N
    rows: int                         # rows of x and g measured
    rows_total: int                   # rows the layer saw in that step (M)
    formats: tuple[FormatWhatIf, ...]

    @property
    def swappable(self) -> bool:
        """Whether an fp8 recipe's swap can take this layer (both weight dims multiples of 16): the
        what-if measures any shape, but a layer the swap cannot take stays in the base precision."""
        return shape_takes_fp8(self.out_features, self.in_features)

    def result(self, fmt: str) -> FormatWhatIf:
        """The result of the format named ``fmt`` (a FORMATS name)."""
        for r in self.formats:
            if r.format == fmt:
                return r
        raise ValueError(f"no what-if for format {fmt!r}; measured: {', '.join(r.format for r in self.formats)}")

    def cheapest(self, floor_db: float) -> FormatWhatIf | None:
        """The tolerated format with the fewest bits per element (ties: FORMATS order), or None."""
        ok = [r for r in self.formats if r.tolerated(floor_db)]
        return min(ok, key=lambda r: (r.bits, _order(r.format))) if ok else None


@dataclasses.dataclass(frozen=True)
class WhatIfReport:
    """The what-if of one doctor run: per captured linear layer, in model order."""

    floor_db: float
    max_rows: int
    step: int                         # the training step (1-based) whose operands were captured
    seconds: float                    # wall time of the measurement (captures excluded)
    layers: tuple[LayerWhatIf, ...]

    def advice(self, layer: LayerWhatIf) -> str:
        """The cheapest format the layer tolerates at this report's floor, or ``"bf16"``."""
        best = layer.cheapest(self.floor_db)
        return "bf16" if best is None else best.format

    @property
    def subsampled(self) -> tuple[LayerWhatIf, ...]:
        """Layers measured on fewer rows than they saw."""
        return tuple(layer for layer in self.layers if layer.rows < layer.rows_total)


def _order(fmt: str) -> int:
    return FORMATS.index(fmt) if fmt in FORMATS else len(FORMATS)

"""Number formats (fp32, tf32, fp16, bf16, fp8, fp4) and exact rounding into them.

A :class:`Format` describes a binary floating-point layout: 1 sign bit, ``exponent_bits``
of biased exponent and ``mantissa_bits`` of stored fraction. Its range constants are
derived from that layout, not typed in. :func:`quantize` rounds float32 values to a
format the way a hardware cast does (round to nearest, ties to even, gradual
subnormals) and hands the result back as float32, so you can see what a tensor
*becomes* in fp16 without leaving float32. :func:`classify` counts how many values
of a tensor underflow, go subnormal or overflow in a format.

    >>> quantize(torch.tensor([1.0 + 2**-11, 70000.0]), FP16)
    tensor([1., inf])
"""

from __future__ import annotations

import dataclasses
import struct

import ml_dtypes
import numpy as np
import torch

__all__ = [
    "BF16", "FORMATS", "FP16", "FP32", "FP4_E2M1", "FP8_E4M3", "FP8_E5M2", "TF32",
    "Format", "RangeCounts", "classify", "get_format", "quantize",
]


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format: sign, biased exponent, stored mantissa.

    ``max``, ``min_normal``, ``min_subnormal`` and ``eps`` are derived from the bit
    layout in ``__post_init__``. With bias ``b = 2**(exponent_bits-1) - 1`` the smallest
    normal exponent is ``1 - b``; the largest is ``2**exponent_bits - 2 - b`` when the
    all-ones exponent is reserved for inf/NaN (IEEE style, ``has_inf=True``), and one
    more for e4m3fn, which keeps only S.1111.111 as NaN and so tops out at 1.75 * 2**8.
    A format with neither inf nor NaN (``has_nan=False``: fp4 e2m1) uses every pattern:
    its all-ones pattern is its max, 1.5 * 2**2 = 6 for e2m1.

        >>> FP16.max, FP16.min_normal, FP16.min_subnormal, FP16.eps
        (65504.0, 6.103515625e-05, 5.960464477539063e-08, 0.0009765625)
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bits: int  # storage bits; tf32 lives in a 32-bit container
    has_inf: bool
    torch_dtype: torch.dtype | None  # None where torch has no storage dtype (tf32)
    numpy_dtype: type | None  # numpy / ml_dtypes scalar type; None for tf32
    has_nan: bool = True  # False: no NaN pattern either (e2m1); quantize marks its NaNs in the fp32 holder
    max: float = dataclasses.field(init=False)
    min_normal: float = dataclasses.field(init=False)
    min_subnormal: float = dataclasses.field(init=False)
    eps: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        # quantize() works on the float32 bit pattern, so a format must fit inside fp32.
        if not 2 <= self.exponent_bits <= 8:
            raise ValueError(f"exponent_bits must be in 2..8, got {self.exponent_bits}")
        if not 1 <= self.mantissa_bits <= 23:
            raise ValueError(f"mantissa_bits must be in 1..23, got {self.mantissa_bits}")
        if self.bits < 1 + self.exponent_bits + self.mantissa_bits:
            raise ValueError(f"bits={self.bits} cannot hold 1 + {self.exponent_bits} + {self.mantissa_bits} bits")
        if self.has_inf and not self.has_nan:
            raise ValueError("a format with inf has NaN too (IEEE keeps the all-ones exponent for both)")
        m = self.mantissa_bits
        if self.has_inf or not self.has_nan:  # top exponent reserved, or no NaN at all: significand 2 - 2**-m
            top = (2.0 - 2.0**-m) * 2.0**self.max_exponent
        else:  # e4m3fn: top exponent usable, but all-ones mantissa is NaN -> 2 - 2**(1-m)
            top = (2.0 - 2.0 ** (1 - m)) * 2.0**self.max_exponent
        # Powers of two and these significands are exact in float64; object.__setattr__
        # is how a frozen dataclass fills derived fields.
        object.__setattr__(self, "max", top)
        object.__setattr__(self, "min_normal", 2.0**self.min_exponent)
        object.__setattr__(self, "min_subnormal", 2.0 ** (self.min_exponent - m))
        object.__setattr__(self, "eps", 2.0**-m)

    @property
    def bias(self) -> int:
        """Exponent bias, ``2**(exponent_bits - 1) - 1`` (15 for fp16)."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of ``min_normal`` (-14 for fp16)."""
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of ``max`` (15 for fp16, 8 for e4m3fn)."""
        reserved = 1 if self.has_inf else 0  # IEEE keeps the all-ones exponent for inf/NaN
        return 2**self.exponent_bits - 1 - reserved - self.bias


FP32 = Format("fp32", 8, 23, 32, True, torch.float32, np.float32)
TF32 = Format("tf32", 8, 10, 32, True, None, None)  # tensor-core input format; stored as fp32
FP16 = Format("fp16", 5, 10, 16, True, torch.float16, np.float16)
BF16 = Format("bf16", 8, 7, 16, True, torch.bfloat16, ml_dtypes.bfloat16)
FP8_E4M3 = Format("fp8_e4m3", 4, 3, 8, False, torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn)
FP8_E5M2 = Format("fp8_e5m2", 5, 2, 8, True, torch.float8_e5m2, ml_dtypes.float8_e5m2)
# OCP fp4: no inf, no NaN, values 0, 0.5, 1, 1.5, 2, 3, 4, 6. torch's float4_e2m1fn_x2 packs two per
# byte (no elementwise cast), so there is no torch dtype; the values are held as fp32.
FP4_E2M1 = Format("fp4_e2m1", 2, 1, 4, False, None, ml_dtypes.float4_e2m1fn, has_nan=False)

FORMATS: dict[str, Format] = {f.name: f for f in (FP32, TF32, FP16, BF16, FP8_E4M3, FP8_E5M2, FP4_E2M1)}

_ALIASES: dict[str, Format] = {
    **FORMATS,
    "float32": FP32, "float": FP32, "single": FP32,
    "tensorfloat32": TF32,
    "float16": FP16, "half": FP16,
    "bfloat16": BF16,
    "e4m3": FP8_E4M3, "e4m3fn": FP8_E4M3, "fp8_e4m3fn": FP8_E4M3, "float8_e4m3fn": FP8_E4M3,
    "e5m2": FP8_E5M2, "float8_e5m2": FP8_E5M2,
    "e2m1": FP4_E2M1, "float4_e2m1fn": FP4_E2M1, "fp4_e2m1fn": FP4_E2M1,
}
_BY_TORCH_DTYPE: dict[torch.dtype, Format] = {f.torch_dtype: f for f in FORMATS.values() if f.torch_dtype}


def get_format(spec: str | Format | torch.dtype) -> Format:
    """Return the :class:`Format` for a name, an alias, a torch dtype or a Format.

    Names are case-insensitive; ``-`` and ``_`` are interchangeable.

        >>> get_format("half") is get_format(torch.float16) is FP16
        True
    """
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, torch.dtype):
        if spec in _BY_TORCH_DTYPE:
            return _BY_TORCH_DTYPE[spec]
        valid = ", ".join(str(d) for d in _BY_TORCH_DTYPE)
        raise ValueError(f"no format for torch dtype {spec}; valid dtypes: {valid}")
    if isinstance(spec, str):
        key = spec.strip().lower().replace("-", "_")
        if key in _ALIASES:
            return _ALIASES[key]
        raise ValueError(
            f"unknown format {spec!r}; valid names: {', '.join(FORMATS)} "
            f"(aliases: {', '.join(k for k in _ALIASES if k not in FORMATS)})"
        )
    raise TypeError(f"expected a format name, Format or torch.dtype, got {type(spec).__name__}")


def _f32_bits(value: float) -> int:
    """The float32 bit pattern of ``value`` as a Python int (value must be fp32-exact)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


_INF_BITS = 0x7F800000  # exponent all ones, mantissa 0
_NAN_BITS = 0x7FC00000  # canonical quiet NaN


def quantize(x: torch.Tensor, fmt: str | Format | torch.dtype, saturate: bool = False) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return the result as float32 values.

    Numerically this is a hardware cast float32 -> ``fmt`` -> float32: round to nearest,
    ties to even, gradual subnormals, signed zeros kept. A value overflows when it
    rounds (with an unbounded exponent) above ``fmt.max``: fp16 65519.99 -> 65504 but
    65520 (the tie above max) -> inf. Overflow gives ±inf, or NaN for e4m3fn, which has
    no inf (its 464, the tie above 448, still rounds down to 448). ``saturate=True``
    clamps finite overflow to ±max instead; it never touches inf input, which stays
    ±inf (NaN for e4m3fn, like ml_dtypes' cast). NaN stays NaN.

    fp4 e2m1 has neither inf nor NaN, so NaN in its fp32 holder means "not representable":
    overflow without ``saturate`` (7, the tie above 6, rounds up to 8), inf and NaN input all
    give NaN (ml_dtypes' cast instead saturates them, and turns NaN into 0). With
    ``saturate=True`` finite values clamp to ±6, exactly as ml_dtypes does.

    Non-float32 float input is first converted to float32 (float64 input is thus
    rounded twice). Pure int32 bit arithmetic: runs on any device, no host sync.

        >>> quantize(torch.tensor([464.0, 465.0, -1e9]), "e4m3", saturate=True)
        tensor([ 448.,  448., -448.])
    """
    fmt = get_format(fmt)
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    x_f32 = x.to(torch.float32, copy=True)
    if fmt.mantissa_bits == 23 and fmt.exponent_bits == 8:
        return x_f32  # fp32 to fp32 is exact

    m, e_min = fmt.mantissa_bits, fmt.min_exponent
    bits = x_f32.view(torch.int32)
    sign = bits & -0x80000000  # keep only the sign bit (int32 min is 0x80000000)
    is_finite = (bits & 0x7F800000) != 0x7F800000  # exponent field not all ones
    is_nan = (bits & 0x7FFFFFFF) > _INF_BITS  # all-ones exponent, nonzero mantissa
    abs_bits = torch.where(is_finite, bits & 0x7FFFFFFF, 0)  # zeroing inf/NaN keeps the adds below in range

    biased = abs_bits >> 23  # fp32 exponent field, 0..254
    biased_eff = biased.clamp(min=1)  # fp32 subnormals (field 0) share the exponent of field 1
    # Integer significand: implicit leading 1 for normals, none for subnormals.
    sig = torch.where(biased > 0, (abs_bits & 0x7FFFFF) | 0x800000, abs_bits & 0x7FFFFF)
    # Bits of `sig` to drop: 23 - m in fmt's normal range; below fmt's min exponent the
    # quantum is fixed at min_subnormal, so one more bit goes per binade. Past 25 every
    # sig < 2**24 rounds to 0 anyway, and capping keeps 1 << shift inside int32.
    shift = ((23 - m) + (e_min - (biased_eff - 127)).clamp(min=0)).clamp(max=25)
    # Round to nearest even: add half a quantum minus one, plus the lowest kept bit, so
    # exact ties round up only when that bit is odd; then clear the dropped bits.
    one = torch.ones_like(shift)
    keep_lsb = (sig >> shift) & 1
    q = ((sig + ((one << (shift - 1)) - 1) + keep_lsb) >> shift) << shift
    # Reassemble: exponent field biased_eff - 1 plus a significand that still carries
    # its implicit bit adds back to the right pattern, and a carry out of the mantissa
    # (q == 2**24) bumps the exponent by one. q == 0 means the value rounded to zero.
    out_abs = torch.where(q == 0, 0, ((biased_eff - 1) << 23) + q)

    # Positive floats order like their bit patterns, so "rounded above max" is an int compare.
    overflow = out_abs > _f32_bits(fmt.max)
    if saturate:
        over_bits = _f32_bits(fmt.max)
    else:
        over_bits = _INF_BITS if fmt.has_inf else _NAN_BITS
    out_abs = torch.where(overflow, over_bits, out_abs)
    # Non-finite input: inf stays inf where the format has one, else (e4m3fn) becomes NaN.
    inf_bits = _INF_BITS if fmt.has_inf else _NAN_BITS
    out_abs = torch.where(is_finite, out_abs, inf_bits)
    out_abs = torch.where(is_nan, _NAN_BITS, out_abs)
    assert out_abs.dtype == torch.int32  # a Python-int-only where() would widen to int64
    return (sign | out_abs).view(torch.float32)


@dataclasses.dataclass(frozen=True)
class RangeCounts:
    """How many values of a tensor land in each range bucket of a format.

    Buckets are disjoint and sum to :attr:`total`: ``zero`` (exactly zero input),
    ``flush`` (nonzero finite input that rounds to 0: underflow), ``subnormal`` (rounds
    to a nonzero subnormal), ``normal``, ``overflow`` (finite input that rounds above
    max) and ``nonfinite`` (input already inf or NaN).
    """

    zero: int
    flush: int
    subnormal: int
    normal: int
    overflow: int
    nonfinite: int

    @property
    def total(self) -> int:
        """Number of values counted."""
        return sum(dataclasses.astuple(self))

    def fractions(self) -> dict[str, float]:
        """Each bucket as a fraction of :attr:`total` (all 0.0 for an empty tensor)."""
        total = self.total
        return {k: (v / total if total else 0.0) for k, v in dataclasses.asdict(self).items()}


def classify(x: torch.Tensor, fmt: str | Format | torch.dtype) -> RangeCounts:
    """Count how the values of ``x`` fare when rounded to ``fmt``.

    One :func:`quantize` pass (without saturation), then one host sync to read the six
    counts back as Python ints. ``zero`` and ``nonfinite`` look at ``x`` itself, so a
    float64 1e300 counts as ``overflow`` in fp32, not as ``nonfinite``.

        >>> classify(torch.tensor([0.0, 1e-8, 1e-6, 1.0, 7e4, float("inf")]), FP16)
        RangeCounts(zero=1, flush=1, subnormal=1, normal=1, overflow=1, nonfinite=1)
    """
    fmt = get_format(fmt)
    q = quantize(x, fmt)
    zero = x == 0
    nonfinite = ~torch.isfinite(x)
    live = ~(zero | nonfinite)  # nonzero finite input: the values rounding can hurt
    overflow = live & ~torch.isfinite(q)
    flush = live & (q == 0)
    subnormal = live & (q != 0) & (q.abs() < fmt.min_normal)
    normal = live & ~(overflow | flush | subnormal)
    masks = (zero, flush, subnormal, normal, overflow, nonfinite)
    counts = torch.stack([mk.sum() for mk in masks]).tolist()  # the one host sync
    return RangeCounts(*counts)

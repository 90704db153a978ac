"""Weight updates that vanish against low-precision weights, counted exactly: the reason master weights exist.

An fp16 weight keeps 11 significant bits: an update smaller than half the gap to its neighbour rounds
back to the same weight and is lost. :func:`update_lost` says, per element, whether adding ``u`` to ``w``
held in a format gives ``w`` back; the doctor's :class:`~.range_collector.RangeCollector` counts those
per module for fp16 and bf16 in every step it watches (``lost_masks``, one compiled kernel for both
formats) and reports them as :class:`UpdateLoss`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..formats import BF16, FP16, Format, get_format, quantize
from ..fusion import FusedFunction

__all__ = ["UPDATE_FORMATS", "UpdateLoss", "lost_masks", "update_lost"]

UPDATE_FORMATS: tuple[Format, ...] = (FP16, BF16)

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_MAX_CODES: dict[tuple[str, torch.dtype], int] = {}


def _max_code(fmt: Format, stored: torch.dtype, int_dtype: torch.dtype) -> int:
    """``fmt.max``'s bit pattern in its storage dtype, as a Python int (kept: traced code reads it as
    a constant, where computing it would read a tensor back)."""
    key = (fmt.name, stored)
    if key not in _MAX_CODES:
        _MAX_CODES[key] = int(torch.tensor(fmt.max).to(stored).view(int_dtype))
    return _MAX_CODES[key]


def _lost_fp16_bf16(w32: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`update_lost` for each of :data:`UPDATE_FORMATS`, from the same fp32 weights and updates."""
    bits = _update_bits(u)
    return tuple(_lost(w32, *bits, f) for f in UPDATE_FORMATS)


# One compiled kernel for both formats' masks (about forty eager kernels otherwise).
_fused_lost = FusedFunction(_lost_fp16_bf16, "lost-update count")


def lost_masks(w32: torch.Tensor, u: torch.Tensor, fused: bool = True) -> tuple[torch.Tensor, ...]:
    """Where each of :data:`UPDATE_FORMATS` loses the updates ``u`` of the fp32 weights ``w32`` (one mask
    per format), compiled unless ``fused=False``; the constants it reads are made first. No sync."""
    for f in UPDATE_FORMATS:
        _max_code(f, f.torch_dtype, _INT_VIEW[f.torch_dtype.itemsize])
    return _fused_lost(w32, u, fused=fused)


def update_lost(w: torch.Tensor, u: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Where adding the nonzero update ``u`` to ``w`` held in ``fmt`` rounds back to the same weight.

    ``w`` is first rounded to ``fmt`` (as a low-precision model holds it): ``w_q``. Round to nearest
    even puts ``w_q + u`` back on ``w_q`` exactly when ``|u|`` is below half the gap to ``w_q``'s
    neighbour in ``u``'s direction, or equal to it with ``w_q``'s significand even. The neighbour is
    found on ``w_q``'s bit pattern in ``fmt``'s own storage (magnitude plus or minus one step), so the
    denser binade below a power of two, the subnormals and zero need no special cases; the gap is an
    exact fp32 difference of two neighbours (a power of two), halved exactly. Past ``fmt.max`` the
    neighbour is inf (NaN for e4m3fn): there the gap is the one below max, as rounding has it (max is
    never a power of two). No fp32 sum ``w_q + u`` is ever rounded twice. Zero, inf and NaN updates
    are never "lost"; nor is anything on a non-finite ``w_q``. No host sync.

        >>> w = torch.ones(4)
        >>> update_lost(w, torch.tensor([2**-12, 2**-11, 3 * 2**-12, -2**-12]), "fp16")
        tensor([ True,  True, False,  True])
    """
    return _lost(w.detach().to(torch.float32), *_update_bits(u), get_format(fmt))


def _update_bits(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``u``'s fp32 bit pattern, and ``|u|``'s minus 1 with the sign bit cleared (0 goes to the top).

    Nonnegative floats order like their int32 patterns: :func:`_lost` compares ``|u|`` there, and the
    shift sends ``|u| == 0`` above everything, so one compare also leaves zero updates out.
    """
    u32 = u.detach().to(torch.float32)
    return u32.view(torch.int32), u32.abs().view(torch.int32).sub_(1).bitwise_and_(0x7FFFFFFF)


def _lost(w32: torch.Tensor, u_bits: torch.Tensor, size_bits: torch.Tensor, fmt: Format) -> torch.Tensor:
    """:func:`update_lost` on fp32 weights and the two patterns of :func:`_update_bits` (shared by
    the formats, so the collector computes them once per update)."""
    if fmt in (FP16, BF16):
        # The hardware cast rounds to nearest even with subnormals and overflow to inf, as quantize
        # does (tests/test_ranges.py checks update_lost against a quantize-based derivation).
        stored, step = w32.to(fmt.torch_dtype), 1
    elif fmt.torch_dtype is not None and fmt.torch_dtype.itemsize * 8 == fmt.bits:
        # fp8: torch's e4m3fn cast saturates instead of giving NaN, so round with quantize; the cast
        # of a value fmt holds exactly (or of NaN/inf) is then exact.
        stored, step = quantize(w32, fmt).to(fmt.torch_dtype), 1
    else:
        # tf32: an fp32 container whose exponent range is fp32's, so fmt's neighbours, subnormals
        # included, are 2**(23 - mantissa_bits) fp32 bit patterns apart.
        stored, step = quantize(w32, fmt), 1 << (23 - fmt.mantissa_bits)
    nbits = 8 * stored.element_size()
    int_dtype = _INT_VIEW[stored.element_size()]
    code = stored.view(int_dtype)
    magnitude = code & ((1 << (nbits - 1)) - 1)                  # clear the sign bit
    # Everything below is integer and in-place fp32 arithmetic: on the CPU, bool-valued float
    # compares and fresh temporaries cost several times an integer pass.
    u_sign = u_bits if nbits == 32 else (u_bits >> (32 - nbits)).to(int_dtype)   # keeps u's sign bit
    # -1 where u points toward zero from a nonzero w_q (signs differ), else 0: arithmetic shifts.
    toward = ((u_sign ^ code) >> (nbits - 1)) & ((-magnitude) >> (nbits - 1))
    neighbour = magnitude + step + toward * (2 * step)          # magnitude +- one step
    w_abs = magnitude.view(stored.dtype).float()
    half_gap = neighbour.view(stored.dtype).float().sub_(w_abs).abs_()   # exact: adjacent values
    top_gap = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)   # the gap just below max
    half_gap.nan_to_num_(nan=top_gap, posinf=top_gap).mul_(0.5)   # a power of two: halving is exact
    # No update is lost on a non-finite w_q: the smallest non-finite code is one step above max's.
    first_nonfinite = _max_code(fmt, stored.dtype, int_dtype) + step
    half_gap.masked_fill_(magnitude >= first_nonfinite, 0.0)
    # With odd = w_q's last significand bit, "lost" is 0 < |u| < half_gap, or |u| == half_gap with
    # w_q even: 0 < |u|_bits < half_bits + 1 - odd, i.e. size_bits (= |u|_bits - 1, zero at the top)
    # < half_bits - odd: one compare. NaN and inf |u| are above every finite half_gap: never lost.
    odd = (magnitude >> (step.bit_length() - 1)) & 1
    return size_bits < half_gap.view(torch.int32).sub_(odd.to(torch.int32))   # same dtypes: a fast loop


@dataclasses.dataclass(frozen=True)
class UpdateLoss:
    """Weight updates of one module counted over the collected steps (skipped steps left out).

    ``lost[fmt]`` counts the nonzero updates that would round away on weights held in ``fmt``.
    """

    updates: int
    zeros: int
    lost: dict[str, int]

    def fraction(self, fmt: str) -> float:
        """Lost updates as a fraction of the nonzero ones (0.0 when there are none)."""
        live = self.updates - self.zeros
        return self.lost[fmt] / live if live else 0.0

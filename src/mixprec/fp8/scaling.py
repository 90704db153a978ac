"""Per-tensor fp8 scales (current and delayed) and the saturating cast they feed.

A tensor ``x`` goes to fp8 as ``q = cast(x * scale)`` and comes back as ``q / scale``. The scale maps
the tensor's largest magnitude (its amax) onto the format's max, so the whole fp8 range is used::

    >>> amax = torch.tensor(3.5)
    >>> current_scale(amax, FP8_E4M3, margin=0, pow2=False)   # 448 / 3.5
    tensor(128.)

Fallbacks, so that an amax of 0, inf or NaN never poisons a scale:

- current scaling: where amax is 0 or not finite the scale is 1 (a zero tensor stays zero; a tensor
  holding inf or NaN casts to inf/NaN and the loss scaler or the user sees the overflow, while the
  scale state stays finite);
- delayed scaling: a non-finite amax enters the history as 0, and a zero amax from the history is
  replaced by this cast's own amax (so the very first cast, with an empty history, uses current
  scaling), and if that too is 0 or not finite the previous scale is kept (initially 1).

Every function here works on device tensors and never syncs with the host.
"""

from __future__ import annotations

import math

import torch

from ..formats import FP8_E4M3, FP8_E5M2, Format, quantize

__all__ = ["amax_f32", "current_scale", "delayed_scale", "record_amax", "cast_to_fp8", "quantize_fp8",
           "FP8_E4M3", "FP8_E5M2"]

# The largest scale handed out: 2**64. A tensor whose amax is below F.max * 2**-64 (about 2.4e-17
# for e4m3) is cast as if its amax were that floor: its values land in fp8's subnormals or flush,
# and the scale, its reciprocal and x * scale all stay finite fp32 numbers.
_MAX_SCALE = 2.0**64


def amax_f32(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a 0-d fp32 tensor (exact: a max picks an existing value). NaN if x holds NaN."""
    # The inf-norm is max |x| in one reduction, without abs()'s full-size temporary. Every step casts
    # three tensors per layer through here: no cast of an fp32 amax, and no float("inf") call.
    # Detached only where autograd would record the norm (an fp8 layer's casts run inside its
    # autograd.Function, with grad mode off: a detach there is an op per cast for nothing).
    amax = torch.linalg.vector_norm(x.detach() if x.requires_grad and torch.is_grad_enabled() else x, math.inf)
    return amax if amax.dtype == torch.float32 else amax.to(torch.float32)


def _usable_or_zero(amax: torch.Tensor) -> torch.Tensor:
    """``amax`` where it can set a scale (positive and finite), 0 where it cannot (0, inf, NaN): an amax
    is a largest magnitude, never negative. ``.bool()`` of the result says which. Scalar-argument
    kernels only: a comparison with a Python number (``amax > 0``) wraps the number in a tensor first,
    about 4 us a comparison on a CPU, and a cast makes several."""
    return amax.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _from_amax(amax: torch.Tensor, fmt: Format, margin: int, pow2: bool) -> torch.Tensor:
    """``fmt.max / amax / 2**margin`` in fp32, capped at 2**64; rounded down to 2**k when ``pow2``."""
    # clamp(min=...) keeps the quotient finite for tiny or zero amax (callers replace those anyway).
    # One correctly rounded division: ``fmt.max / tensor`` would go through ``Tensor.__rtruediv__``,
    # which is ``reciprocal() * fmt.max``, two roundings, one ulp off fl(fmax / amax) in about a
    # quarter of amaxes. A tensor numerator keeps it a true ``div``, eager and compiled alike.
    fmax = torch.full_like(amax, fmt.max, dtype=torch.float32)
    scale = torch.div(fmax, amax.clamp(min=fmt.max / _MAX_SCALE))
    if margin:
        scale = scale * 2.0**-margin     # exact; with no margin it would be a multiply by 1
    if pow2:
        # frexp: scale = mant * 2**exp with mant in [0.5, 1), so 2**(exp - 1) <= scale exactly;
        # log2 could round up just below a power of two and make x * scale overflow the format.
        _, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - 1)
    return scale


def current_scale(amax: torch.Tensor, fmt: Format, *, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """The scale for a tensor whose amax is ``amax`` now; 1 where amax is 0, inf or NaN."""
    amax = amax.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)     # _usable_or_zero, inline: every cast
    return _from_amax(amax, fmt, margin, pow2).masked_fill_(amax.logical_not(), 1.0)


def delayed_scale(history: torch.Tensor, amax_now: torch.Tensor, prev_scale: torch.Tensor, fmt: Format, *,
                  algo: str = "max", margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """The scale from an amax history (``history[0]`` the most recent), before this cast is recorded.

    ``algo="max"`` takes the largest entry, ``"recent"`` the newest. Where that is 0 (an empty history,
    or only zero/non-finite tensors seen), this cast's own amax ``amax_now`` stands in; where that too
    is unusable, ``prev_scale`` is kept.
    """
    amax = _usable_or_zero(history.amax() if algo == "max" else history[0])
    amax = _usable_or_zero(torch.where(amax.bool(), amax, amax_now))
    return torch.where(amax.bool(), _from_amax(amax, fmt, margin, pow2), prev_scale)


def record_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Shift ``history`` one place back (dropping the oldest) and put ``amax`` first; in place, no sync.

    A non-finite amax is recorded as 0, which the scale formula ignores: one overflowing step does
    not freeze the scale for ``len(history)`` steps.
    """
    history.copy_(torch.roll(history, 1))
    history[0] = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``x * scale`` rounded to ``fmt`` as a torch float8 tensor, saturating finite overflow.

    The product is formed in fp32 (one rounding), finite values beyond ``fmt.max`` clamp to it, and
    the cast rounds to nearest even. Non-finite values stay non-finite: inf stays inf in e5m2 and
    becomes NaN in e4m3, which has no inf (torch's CPU cast would turn +inf into 448 and hide it).
    Bit for bit ``quantize(x * scale, fmt, saturate=True)`` (tests/test_fp8.py checks it).
    """
    y = (x if x.dtype == torch.float32 else x.to(torch.float32)) * scale    # a new tensor either way
    if fmt.has_inf:
        y = torch.where(torch.isinf(y), y, y.clamp(-fmt.max, fmt.max))       # clamp keeps NaN as NaN
    else:   # +-inf -> NaN first (the clamp would make them +-max), in place on the product
        y = torch.nan_to_num_(y, nan=math.nan, posinf=math.nan, neginf=math.nan).clamp_(-fmt.max, fmt.max)
    return y.to(fmt.torch_dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The emulation of ``cast_to_fp8``: the same fp8 values, held as fp32 (any device, any torch).

    On CPU and CUDA the values come from torch's own float8 cast and back (``cast_to_fp8`` is bit for
    bit ``quantize``'s saturating rounding: tests/test_fp8_scaling.py): 3 elementwise passes instead
    of the bit arithmetic's ~20, which made the emulated gpt step ~1.6x slower on a CPU. Elsewhere, or
    on a torch without float8 dtypes, ``formats.quantize``'s integer arithmetic rounds them.
    """
    if x.device.type in ("cpu", "cuda") and fmt.torch_dtype is not None:
        return cast_to_fp8(x, scale, fmt).to(torch.float32)
    return quantize(x.to(torch.float32) * scale, fmt, saturate=True)

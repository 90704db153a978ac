"""Block-scaled quantization: one scale per block of a GEMM operand (rowwise, 1x128, 128x128, MXFP8, NVFP4).

Per-tensor fp8 gives a whole tensor one scale, so a single outlier pushes every other value towards the
subnormals. Block scaling gives each run of ``block`` values along the contraction axis its own decode
scale ``d`` (optionally each ``block_rows x block`` tile), and stores ``q = round(x / d)`` in the element
format; a GEMM multiplies blocks of ``q`` and applies the two decodes to its fp32 partial sums. Here
``q`` is held as fp32 grid values and ``dequantize_blocked`` gives ``q * d``, the exact emulation::

    >>> x = torch.tensor([[1.0, -2.0, 3.0, 704.0]])
    >>> q, d = quantize_blocked(x, BlockScaling(FP8_E4M3, block=2, scale="e8m0"), axis=1)
    >>> d                       # 2**ceil(log2(amax / 448)) per block of 2
    tensor([[0.0078, 2.0000]])
    >>> q                       # x / d, here on the e4m3 grid already
    tensor([[ 128.0000, -256.0000,    1.5000,  352.0000]])

Scale encodings (``BlockScaling.scale``), for a block with ``amax = max |x|`` and element max ``M``:

- ``"fp32"``: ``d = amax / M`` in fp32 (DeepSeek-V3's 1x128 / 128x128 tiles);
- ``"pow2"``: ``d = 2**ceil(log2(amax / M))`` exactly (the per-tensor ``pow2`` scale, per block):
  scaling by ``d`` rounds nothing and nothing saturates;
- ``"e8m0"``: the same powers of two, held to e8m0's range ``[2**-127, 2**127]`` (OCP MX blocks with
  NVIDIA's MXFP8 rounding up; the OCP reference's ``2**(floor(log2 amax) - 8)`` saturates top values);
- ``"e4m3"``: NVFP4. A tensor decode ``t = amax_tensor / (M * 448)`` in fp32 (``amax_tensor`` over the
  finite blocks), a per-block code ``c = e4m3(amax / M / t)`` (saturating) and ``d = c * t`` in fp32. A
  code that underflows to 0 gives ``d = 0``: that block's values flush to 0.

Special blocks: an all-zero block gets ``d = 1`` (0 for ``"e4m3"``: its code is 0); a block holding inf
or NaN gets ``d = NaN`` and all its values become NaN, so an overflow is never hidden (the loss scaler
sees it) and never spoils the scales of the other blocks.

Elements round to nearest, ties to even, and saturate at ``M``: fp8 through torch's own float8 casts on
CPU and CUDA; e2m1 (and fp8 elsewhere) by one fp32 add and subtract of a magic number. With ``noise``
(int32, its low 16 bits uniform) the rounding is stochastic: up with probability equal to the dropped
fraction of a grid step (truncated to 16 bits), so ``E[q] = x / d`` to within ``2**-16`` of a step for
``|x / d| <= M`` (exactly when that fraction is a multiple of ``2**-16``); ``q`` is always one of the two
grid neighbours of ``x / d`` saturated at ``M``. ``rounding_noise`` makes that noise from a ``RoundingNoise``.

Everything here is tensor ops on the device: no host sync, traceable by ``torch.compile``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..formats import FP4_E2M1, FP8_E4M3, FP8_E5M2, Format
from ..update.stochastic_rounding import RoundingNoise

__all__ = ["BlockScaling", "quantize_blocked", "dequantize_blocked", "fake_quantize_blocked",
           "random_hadamard", "range_counts", "rounding_noise", "SCALE_KINDS", "SR_NOISE_BITS"]

SCALE_KINDS = ("fp32", "pow2", "e8m0", "e4m3")
SR_NOISE_BITS = 16                              # bits of each noise value stochastic rounding reads
_ELEMS = (FP8_E4M3, FP8_E5M2, FP4_E2M1)
_F32_MIN_NORMAL = 2.0**-126                     # smallest fp32/pow2 decode: keeps 1/d finite
_E8M0_MIN, _E8M0_MAX = 2.0**-127, 2.0**127      # e8m0: exponent bias 127, no zero, 0xFF is NaN


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """How one GEMM operand is quantized: element format, block shape, scale encoding.

    ``block`` elements share a scale along the blocked (contraction) axis, 0 meaning the whole axis
    (rowwise); ``block_rows > 1`` makes 2-D tiles of ``block_rows`` along the other axis (128x128
    weights, NVFP4's 16x16 weights).

        >>> BlockScaling(FP4_E2M1, block=16, scale="e4m3").tile(axis=0)
        (16, 1)
    """

    elem: Format
    block: int
    block_rows: int = 1
    scale: str = "fp32"

    def __post_init__(self) -> None:
        if self.elem not in _ELEMS:
            raise ValueError(f"block elements must be one of {', '.join(f.name for f in _ELEMS)}, "
                             f"got {getattr(self.elem, 'name', self.elem)!r}")
        for name, low in (("block", 0), ("block_rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"unknown block scale {self.scale!r}; valid: {', '.join(SCALE_KINDS)}")

    def tile(self, axis: int) -> tuple[int, int]:
        """``(rows, cols)`` of one block of a 2-D operand blocked along ``axis``; 0 = the whole dimension."""
        return (self.block_rows, self.block) if _axis(axis) == 1 else (self.block, self.block_rows)


def _axis(axis: int) -> int:
    if axis not in (0, 1, -1, -2):
        raise ValueError(f"axis must be 0 or 1 (the contraction axis of the 2-D operand), got {axis!r}")
    return axis % 2


def _check(x: torch.Tensor, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D (a GEMM operand), got shape {tuple(x.shape)}: reshape "
                         f"to (-1, x.shape[-1]) first")


def _geometry(shape: torch.Size, how: BlockScaling, axis: int) -> tuple[int, int, int, int]:
    """``(t0, t1, n0, n1)``: the tile and the number of tiles along each dim (the last may be ragged)."""
    t0, t1 = how.tile(axis)
    t0, t1 = t0 or max(shape[0], 1), t1 or max(shape[1], 1)
    return t0, t1, -(-shape[0] // t0), -(-shape[1] // t1)


def _tiles(x: torch.Tensor, t0: int, t1: int, n0: int, n1: int) -> torch.Tensor:
    """``x`` zero-padded to whole tiles, viewed as ``(n0, t0, n1, t1)`` (a view when nothing is padded)."""
    pad0, pad1 = n0 * t0 - x.shape[0], n1 * t1 - x.shape[1]
    if pad0 or pad1:
        x = F.pad(x, (0, pad1, 0, pad0))          # zeros: they never change a block's amax
    return x.reshape(n0, t0, n1, t1)


def _pow2_ceil(r: torch.Tensor, amax: torch.Tensor, top: float) -> torch.Tensor:
    """The least ``2**k`` with ``amax <= top * 2**k``, from ``r = fl(amax / top)``; exact."""
    # frexp: r = f * 2**e with f in [0.5, 1), so r <= 2**e; the rounding of r can put the true ratio
    # only just above 2**(e-1), so k is e or e - 1, and the exact test below picks it (top * 2**(e-1)
    # is exact: top has a few significant bits and 2**(e-1) is a power of two).
    _, e = torch.frexp(r)
    d = torch.ldexp(torch.ones_like(r), e)
    return torch.where(amax <= top * (d * 0.5), d * 0.5, d)


def _decode(amax: torch.Tensor, how: BlockScaling) -> torch.Tensor:
    """The fp32 decode scale of each block from its fp32 ``amax`` (see the module docstring)."""
    top = how.elem.max
    finite = torch.isfinite(amax)
    if how.scale == "e4m3":
        amax_f = torch.where(finite, amax, 0.0)
        amax_t = amax_f.amax()                                      # over the finite blocks
        # The tensor decode maps the tensor's amax onto top * 448 (the largest code times the element
        # max); floored at fp32's smallest normal so a subnormal amax cannot divide by 0 below.
        t = torch.where(amax_t > 0, (amax_t / (top * FP8_E4M3.max)).clamp(min=_F32_MIN_NORMAL), 1.0)
        code = _round_nearest_((amax_f / top / t).clamp_(max=FP8_E4M3.max), FP8_E4M3)
        d = code * t
    else:
        if how.scale == "fp32":
            d = (amax / top).clamp(min=_F32_MIN_NORMAL)
        else:
            lo, hi = (_E8M0_MIN, _E8M0_MAX) if how.scale == "e8m0" else (_F32_MIN_NORMAL, 2.0**127)
            d = _pow2_ceil(amax / top, amax, top).clamp(lo, hi)
        d = torch.where(amax > 0, d, 1.0)                           # zero block: any d; e8m0 has no 0
    return torch.where(finite, d, float("nan"))                    # inf/NaN block: all NaN


def _round_nearest_(y: torch.Tensor, fmt: Format, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 ``y`` (``|y| <= fmt.max`` or NaN) rounded to ``fmt``, ties to even: in place, or as ``dtype``."""
    if fmt.torch_dtype is not None and y.device.type in ("cpu", "cuda"):
        q8 = y.to(fmt.torch_dtype)                  # torch's cast: RNE, saturating
        return q8 if dtype == fmt.torch_dtype else y.copy_(q8)   # copy_ reuses y's memory
    return _round_magic_(y, fmt).to(dtype)


def _round_magic_(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``_round_nearest_`` in fp32 arithmetic (any device): 7 element-wise passes, one int32 temporary."""
    # c = +-1.5 * 2**(E + 23 - m), E = y's exponent (at least fmt's smallest): y + c lies in the fp32
    # binade whose ulp is y's grid step in fmt, so that add rounds y to fmt's grid (ties to even: c is
    # an even number of steps) and subtracting c is exact. A -0 result gets its sign back from c.
    c = torch.bitwise_and(y.view(torch.int32), 0x7F800000)         # y's exponent field, sign dropped
    c.clamp_(min=(127 + fmt.min_exponent) << 23).add_(((23 - fmt.mantissa_bits) << 23) | 0x400000)
    c_f32 = torch.copysign(c.view(torch.float32), y, out=c.view(torch.float32))
    return y.add_(c_f32).sub_(c_f32).copysign_(c_f32)


def _round_stochastic_(y: torch.Tensor, fmt: Format, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` (``|y| <= fmt.max`` or NaN) rounded down or up to ``fmt``'s grid without bias, in place."""
    # The grid step around y, signed like y: 2**(E - m), E = y's exponent (at least fmt's smallest).
    step = torch.bitwise_and(y.view(torch.int32), 0x7F800000)
    step.clamp_(min=(127 + fmt.min_exponent) << 23).sub_(fmt.mantissa_bits << 23)
    step_f32 = torch.copysign(step.view(torch.float32), y, out=step.view(torch.float32))
    # s = floor(|y| / step * 2**16) is an exact integer below 2**(m + 17); floor((s + u) / 2**16), u
    # uniform in [0, 2**16), is floor(|y| / step) plus 1 with probability (s mod 2**16) / 2**16: the
    # dropped fraction of a step, truncated to 16 bits. Every factor is a power of two: exact.
    s = y.div_(step_f32).mul_(2.0**SR_NOISE_BITS).floor_()
    s += torch.bitwise_and(noise, 2**SR_NOISE_BITS - 1)
    return s.mul_(2.0**-SR_NOISE_BITS).floor_().mul_(step_f32)


def _amax_tiles(xt: torch.Tensor) -> torch.Tensor:
    """max |x| of each tile of ``xt`` (n0, t0, n1, t1) as fp32 (n0, n1); NaN propagates."""
    n0, t0, n1, t1 = xt.shape
    # aminmax reduces one dim up to 4x faster than vector_norm(inf) or abs().amax() on a CPU, with no
    # full-size temporary; 2-D tiles reduce the (1/t1-size) result a second time.
    if t0 == 1:
        lo, hi = torch.aminmax(xt.reshape(n0, n1, t1), dim=-1)
    elif t1 == 1:
        lo, hi = torch.aminmax(xt.reshape(n0, t0, n1), dim=1)
    else:
        lo, hi = torch.aminmax(xt, dim=3)
        lo, hi = lo.amin(dim=1), hi.amax(dim=1)
    # maximum propagates NaN. An all-zero tile has hi = +0 and -lo = -0, and maximum may return -0:
    # abs_ makes that +0, else nvfp4's zero block got the code -0, a decode of -0 and decoded to -0.0.
    return torch.maximum(hi, -lo).abs_().to(torch.float32)


def _scaled_tiles(x: torch.Tensor, how: BlockScaling, axis: int
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """``(y = x / decode as fp32 tiles (n0, t0, n1, t1), decode (n0, n1), geometry)``, x padded to whole tiles."""
    _check(x)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)                     # float64 (rounded once to fp32, as formats.quantize)
    geometry = _geometry(x.shape, how, axis)
    xt = _tiles(x, *geometry)
    decode = _decode(_amax_tiles(xt), how)
    # A decode of 0 (an e4m3 code that underflowed) flushes its block: x / inf = 0 for finite x.
    div = torch.where(decode == 0, float("inf"), decode) if how.scale == "e4m3" else decode
    return xt / div[:, None, :, None], decode, geometry   # fp32 (bf16/fp16 promote exactly)


def _round_tiles_(y: torch.Tensor, how: BlockScaling, noise: torch.Tensor | None, x_shape: torch.Size,
                  geometry: tuple[int, int, int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The scaled tiles ``y`` rounded to ``how.elem``: in place (fp32), or as ``dtype`` (the fp8 one)."""
    fmt = how.elem
    # Only an e4m3 code, rounded down by up to 1/16, can push |y| past the element's max by more than
    # an fp32 ulp (which rounds back to max anyway): the other scales need no clamp, as |x| <= amax.
    if how.scale == "e4m3" or noise is not None:
        y.clamp_(-fmt.max, fmt.max)                 # saturate; NaN stays NaN
    if noise is None:
        return _round_nearest_(y, fmt, dtype)
    if noise.dtype != torch.int32 or noise.shape != x_shape:
        raise ValueError(f"noise must be int32 with x's shape {tuple(x_shape)}, got "
                         f"{noise.dtype} {tuple(noise.shape)}: see blockscale.rounding_noise")
    return _round_stochastic_(y, fmt, _tiles(noise, *geometry)).to(dtype)   # grid values: exact cast


def _quantize_tiles(x: torch.Tensor, how: BlockScaling, axis: int, noise: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q tiles (n0, t0, n1, t1), decode (n0, n1))`` for x padded to whole tiles."""
    y, decode, geometry = _scaled_tiles(x, how, axis)
    return _round_tiles_(y, how, noise, x.shape, geometry, dtype), decode


def _untile(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n0, t0, n1, t1 = t.shape
    out = t.reshape(n0 * t0, n1 * t1)
    return out if tuple(out.shape) == tuple(shape) else out[:shape[0], :shape[1]].contiguous()


def quantize_blocked(x: torch.Tensor, how: BlockScaling, axis: int, *, noise: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the 2-D ``x`` in blocks along ``axis``: ``(q, decode)``.

    ``q``: fp32, ``x``'s shape, the values ``x / decode`` rounded to ``how.elem`` (saturating at its
    max; NaN in blocks holding inf or NaN). ``decode``: fp32, one per block, shaped like ``x`` in blocks:
    ``(ceil(R / t0), ceil(C / t1))`` for ``x`` of shape ``(R, C)`` and ``(t0, t1) = how.tile(axis)``,
    i.e. ``(block_rows, block)`` for ``axis=1`` and ``(block, block_rows)`` for ``axis=0`` (block 0: the
    whole dimension); ``decode[i, j]`` scales ``x[i*t0:(i+1)*t0, j*t1:(j+1)*t1]``. A dimension that is
    not a multiple of its tile ends in a partial block (padded with zeros inside). ``x`` may be any
    float dtype (float64 is rounded to fp32 first). ``noise``: int32, ``x``'s shape, low 16 bits
    uniform, for stochastic rounding; None rounds to nearest even. ``dtype``: q's dtype, float32 or
    the element's torch float8 dtype (what ``scaled_mm`` takes: saves a cast each way).

        >>> per_column = BlockScaling(FP4_E2M1, 0, scale="pow2")
        >>> q, d = quantize_blocked(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), per_column, 0)
        >>> q, d                # d = 2**ceil(log2(amax / 6))
        (tensor([[2., 2.],
                [6., 4.]]), tensor([[0.5000, 1.0000]]))
    """
    if dtype not in (torch.float32, how.elem.torch_dtype):
        valid = ", ".join(str(d) for d in (torch.float32, how.elem.torch_dtype) if d is not None)
        raise ValueError(f"q's dtype for {how.elem.name} elements must be one of {valid}, got {dtype}")
    q, decode = _quantize_tiles(x, how, axis, noise, dtype)
    return _untile(q, x.shape), decode


def dequantize_blocked(q: torch.Tensor, decode: torch.Tensor, how: BlockScaling, axis: int) -> torch.Tensor:
    """``q * decode`` with each decode broadcast over its block, in fp32: one rounding (none for pow2/e8m0).

        >>> dequantize_blocked(torch.tensor([[2.0, 2.0], [6.0, 4.0]]), torch.tensor([[0.5, 1.0]]),
        ...                    BlockScaling(FP4_E2M1, 0, scale="pow2"), 0)
        tensor([[1., 2.],
                [3., 4.]])
    """
    _check(q, "q")
    t0, t1, n0, n1 = _geometry(q.shape, how, _axis(axis))
    if tuple(decode.shape) != (n0, n1):
        raise ValueError(f"decode has shape {tuple(decode.shape)}, but q of shape {tuple(q.shape)} in "
                         f"{t0}x{t1} blocks needs ({n0}, {n1}): pass the decode quantize_blocked returned "
                         f"with the same how and axis")
    qt = _tiles(q.to(torch.float32), t0, t1, n0, n1)
    return _untile(qt * decode.to(torch.float32)[:, None, :, None], q.shape)


def fake_quantize_blocked(x: torch.Tensor, how: BlockScaling, axis: int, *,
                          noise: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize_blocked(*quantize_blocked(x, ...))`` in fp32, without unpadding in between."""
    q, decode = _quantize_tiles(x, how, axis, noise)
    return _untile(q.mul_(decode[:, None, :, None]), x.shape)


def range_counts(x: torch.Tensor, how: BlockScaling, axis: int) -> torch.Tensor:
    """int64 ``[flushed, saturated, total]`` of quantizing ``x`` (round to nearest), as Fp8Linear counts.

    Flushed: nonzero finite values that became 0. Saturated: finite values whose rounding without the
    clamp would land above the element max (e4m3's 448 < |y| <= 464 still round to 448). Values of a
    block holding inf or NaN count as neither. No host sync.

        >>> range_counts(torch.tensor([[1.0, 1e-6, 0.0, -448.0]]), BlockScaling(FP8_E4M3, 0), 1).tolist()
        [1, 0, 4]
    """
    y, _, geometry = _scaled_tiles(x, how, axis)
    fmt = how.elem
    # The tie above max rounds up (overflows) when max's last mantissa bit is odd: e5m2, e2m1; not e4m3.
    tie = fmt.max + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits) / 2
    odd = int(fmt.max / 2.0**fmt.max_exponent * 2**fmt.mantissa_bits) % 2 == 1
    a = y.abs()
    saturated = (a >= tie).sum() if odd else (a > tie).sum()
    q = _round_tiles_(y, how, None, x.shape, geometry)
    flushed = ((_tiles(x, *geometry) != 0) & (q == 0)).sum()
    return torch.stack([flushed, saturated, torch.tensor(x.numel(), device=x.device)])


def _hadamard16(signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) @ H16 / 4`` in fp32: Sylvester's H16 (entry (i, j) is (-1)**popcount(i & j))."""
    i = torch.arange(16, device=signs.device)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for shift in range(4):                          # popcount of 4-bit numbers, 4 tiny ops
        parity ^= (bits >> shift) & 1
    h = (1 - 2 * parity).to(torch.float32) * 0.25   # +-1/4: exact
    return signs.to(torch.float32)[:, None] * h


def random_hadamard(x: torch.Tensor, signs: torch.Tensor, axis: int) -> torch.Tensor:
    """Each run of 16 values ``v`` along ``axis`` becomes ``v @ (diag(signs) H16 / 4)``, an orthogonal map.

    Both operands of a GEMM transformed along their contraction axis give the same product in exact
    arithmetic (``(a Q)(b Q)^T = a b^T``), while each block's outliers spread over 16 values, which
    suits 16-element fp4 blocks. A ragged tail (length not a multiple of 16) is left as it is: still
    orthogonal. ``signs``: 16 values +-1. Result in fp32 (float64 input stays float64).

        >>> a = torch.arange(16.0)[None]
        >>> bool(torch.allclose(random_hadamard(a, torch.ones(16), 1).square().sum(), a.square().sum()))
        True
    """
    _check(x)
    if signs.numel() != 16:
        raise ValueError(f"signs must hold 16 values +-1 (one per Hadamard row), got {signs.numel()}")
    ax = _axis(axis)
    dtype = torch.promote_types(x.dtype, torch.float32)
    m = _hadamard16(signs.reshape(16)).to(dtype)
    x = x.to(dtype)
    n = x.shape[ax] // 16 * 16
    if ax == 1:
        body = (x[:, :n].reshape(x.shape[0], -1, 16) @ m).reshape(x.shape[0], n)
        return body if n == x.shape[1] else torch.cat([body, x[:, n:]], dim=1)
    body = (m.t() @ x[:n].reshape(-1, 16, x.shape[1])).reshape(n, x.shape[1])   # columns: M^T v
    return body if n == x.shape[0] else torch.cat([body, x[n:]], dim=0)


def rounding_noise(source: RoundingNoise, shape: tuple[int, int], *, start: int = 0,
                   tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """int32 noise of ``shape`` for ``quantize_blocked(..., noise=)``: positions ``start..`` of ``source``.

    ``source.numel`` must cover ``start + rows * cols``; ``tables`` (this step's ``source.tables()``)
    can be shared by several operands. Values are uniform in ``[0, 2**16)``; ``source.advance()``
    moves to the next step's noise.
    """
    rows, cols = shape
    if start < 0 or start + rows * cols > source.numel:
        raise ValueError(f"positions {start}..{start + rows * cols} exceed the noise source's "
                         f"{source.numel} values: make RoundingNoise with numel >= {start + rows * cols}")
    out = torch.empty(rows * cols, dtype=torch.int32, device=source.device)
    source.fill_(out, start, tables if tables is not None else source.tables())
    return out.view(rows, cols)

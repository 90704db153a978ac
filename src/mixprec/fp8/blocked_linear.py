"""The blocked fp8/fp4 linear: one scale per block of each GEMM operand, blocks along that GEMM's
contraction dimension (``fp8=rowwise | block | mxfp8 | nvfp4``; per-tensor scaling is in linear.py).

A linear layer runs three GEMMs, ``y = x W^T`` with ``x`` (M, K) and ``W`` (N, K)::

    GEMM      operands        contracted over   blocks of x          blocks of W          blocks of g
    forward   x @ W^T         K                 along K (axis 1)     along K (axis 1)     -
    grad_x    g @ W           N                 -                    along N (axis 0)     along N (axis 1)
    grad_W    g^T @ x         M                 along M (axis 0)     -                    along M (axis 0)

Why the contraction axis: a scaled GEMM computes ``sum_k (q_a[m,k] d_a) (q_b[k,n] d_b)``. With one
decode scale per block along k, a kernel multiplies the fp8 values of a block with fp32 accumulation
and applies ``d_a d_b`` once to the partial sum, so block scales cost one multiply per block, not per
element. A block laid across the other axis would mix rows that land in different outputs and could
not be factored out of the sum. So each operand is quantized once per GEMM that reads it along its
own contraction axis: ``x`` along K for the forward and along M for ``grad_W``, ``g`` along N and
along M. Weights in 2-D tiles (``block`` 128x128, ``nvfp4`` 16x16) quantize identically along either
axis, so one quantized ``W`` serves the forward and ``grad_x``; 1-D weight blocks are quantized again.

The recipes (``recipe/fp8.py``) in blockscale's terms (``fp8/blockscale.py``)::

    rowwise  x, W, g: e4m3, block = the whole axis (one scale per row), power-of-two fp32 scales
    block    x, g: e4m3 1x128, fp32 scales;  W: e4m3 128x128 tiles
    mxfp8    x, W, g: e4m3 1x32, e8m0 scales
    nvfp4    x, g: e2m1 1x16, e4m3 scales x an fp32 tensor scale;  W: e2m1 16x16 tiles;
             sr: g stochastically rounded in both its GEMMs; rht: g and x multiplied by the same
             random-signed 16x16 Hadamard matrix along M before the grad_W GEMM (orthogonal, so the
             product is unchanged while outliers spread over 16 values)

Emulation (every device): quantize with the format's real rounding and saturation, dequantize, fp32
matmul, one rounding to the output dtype. Kernels where the device has them: rowwise through
``torch._scaled_mm`` with (M, 1) and (1, N) fp32 scales (CPU with torch 2.13, CUDA 8.9+), block
through ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128``/``BlockWise128x128`` on compute
capability 9.x when every dimension is a multiple of 128 (else that GEMM is emulated). MXFP8 and
NVFP4 kernels need Blackwell: emulated here.

    >>> how = blocked_recipe(Fp8Config.parse("nvfp4"))       # what Fp8Linear runs for fp8=nvfp4
    >>> how.input.tile(axis=1), how.weight.tile(axis=1), how.weight_tiles, how.sr, how.rht
    ((1, 16), (16, 16), True, True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..formats import FP4_E2M1, FP8_E4M3, Format
from ..recipe.fp8 import Fp8Config, Fp8Scaling
from ..update.stochastic_rounding import _mix32
from .blockscale import BlockScaling, dequantize_blocked, quantize_blocked, random_hadamard, range_counts
from .matmul import scaled_mm

__all__ = ["BlockedRecipe", "blocked_recipe", "BlockedLinearFn", "sr_noise", "rht_signs", "ROLE_NAMES"]

ROLE_NAMES = ("input", "weight", "grad_output")
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9          # 2**32 / golden ratio, odd: spreads neighbouring indices apart


@dataclasses.dataclass(frozen=True)
class BlockedRecipe:
    """How the three operands of a blocked linear are quantized, and nvfp4's extras."""

    input: BlockScaling
    weight: BlockScaling
    grad_output: BlockScaling
    sr: bool = False          # stochastic rounding of grad_output (both its GEMMs)
    rht: bool = False         # random Hadamard transform of g and x along M before the grad_W GEMM
    kernel: str = ""          # "rowwise" | "block": the scaled-matmul kernel that can run it; "" none

    def role(self, name: str) -> BlockScaling:
        return getattr(self, name)

    @property
    def formats(self) -> dict[str, Format]:
        """Element format per role (``"input"``, ``"weight"``, ``"grad_output"``)."""
        return {name: self.role(name).elem for name in ROLE_NAMES}

    @property
    def weight_tiles(self) -> bool:
        """2-D weight tiles, square: quantized along K they are the same tiles as along N."""
        return self.weight.block_rows == self.weight.block > 1


def blocked_recipe(config: Fp8Config) -> BlockedRecipe:
    """The ``BlockedRecipe`` of a blocked ``Fp8Config`` (``rowwise``, ``block``, ``mxfp8``, ``nvfp4``)."""
    s = config.scaling
    if s is Fp8Scaling.ROWWISE:
        row = BlockScaling(FP8_E4M3, block=0, scale="pow2")
        return BlockedRecipe(row, row, row, kernel="rowwise")
    if s is Fp8Scaling.BLOCK:
        tile = BlockScaling(FP8_E4M3, block=128, scale="fp32")
        return BlockedRecipe(tile, BlockScaling(FP8_E4M3, block=128, block_rows=128, scale="fp32"), tile,
                             kernel="block")
    if s is Fp8Scaling.MXFP8:
        mx = BlockScaling(FP8_E4M3, block=32, scale="e8m0")
        return BlockedRecipe(mx, mx, mx)
    if s is Fp8Scaling.NVFP4:
        nv = BlockScaling(FP4_E2M1, block=16, scale="e4m3")
        return BlockedRecipe(nv, BlockScaling(FP4_E2M1, block=16, block_rows=16, scale="e4m3"), nv,
                             sr=bool(config.sr), rht=bool(config.rht))
    raise ValueError(f"fp8={s.value} is per-tensor scaling, not blocked: Fp8Linear runs it in linear.py")


# ------------------------------------------------------------------------ noise and signs
def _table(seed: torch.Tensor, word: int | torch.Tensor, n: int, offset: int) -> torch.Tensor:
    """``n`` hashed 32-bit words (int64 in [0, 2**32)) for indices ``offset..offset+n`` under ``word``."""
    index = torch.arange(offset, offset + n, dtype=torch.int64, device=seed.device)
    return _mix32(_mix32(((index * _GOLDEN) & _MASK32) ^ seed) ^ word)


def sr_noise(seed: torch.Tensor, steps: torch.Tensor, stream: int, rows: int, cols: int) -> torch.Tensor:
    """int32 uniform noise (all 32 bits) for stochastically rounding a (rows, cols) operand.

    ``noise[i, j] = U[i] ^ T[j]``, tables hashed from the layer's ``seed``, its backward count ``steps``
    and ``stream`` (one per use of g in a backward): uniform, and any two positions independent (they
    differ in a row, so in U, or in a column, so in T), which is all the variance of a rounded dot
    product depends on (``stochastic_rounding.RoundingNoise`` argues it at length). One broadcast xor;
    no host sync, no generator draw: compiles, and a checkpoint of ``steps`` replays the same noise.
    """
    # The step's word: steps * 2 + stream, times an odd constant modulo 2**32 (used as the negative
    # 0x9E3779B9 - 2**32 so that the int64 product cannot overflow), then hashed.
    word = _mix32((((steps * 2 + stream) & _MASK32) * -0x61C88647) & _MASK32)
    table = _table(seed, word, rows + cols, 0)
    table = table - ((table >> 31) << 32)          # the same 32 bits as a signed int32 value
    u, t = table[:rows].to(torch.int32), table[rows:].to(torch.int32)
    return torch.bitwise_xor(u[:, None], t[None, :])       # (rows, cols)


def rht_signs(seed: int) -> torch.Tensor:
    """The 16 fixed random signs (+-1.0, fp32) of a layer's random Hadamard transform, from its seed."""
    bits = _table(torch.tensor(seed % 2**32, dtype=torch.int64), 0x5EED, 16, 0) >> 16
    return 1.0 - 2.0 * (bits & 1).to(torch.float32)


# ------------------------------------------------------------------------------ the GEMMs
def _rowwise_mm(a_q: torch.Tensor, a_d: torch.Tensor, b_q: torch.Tensor, b_d: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` through ``torch._scaled_mm`` with row scales: a (M, K), b (N, K), decodes (M, 1), (N, 1).

    The grid values are e4m3 already (quantized and saturated), so the cast to float8 is exact.
    """
    a8, b8 = a_q.to(torch.float8_e4m3fn), b_q.to(torch.float8_e4m3fn)
    return scaled_mm(a8, b8.t(), a_d.reshape(-1, 1).contiguous(), b_d.reshape(1, -1).contiguous(), out_dtype)


def _block_kernel_fits(*dims: int) -> bool:
    # cuBLASLt's DeepSeek-style kernels take whole 128-blocks only (torch's checks use K // 128).
    return all(d % 128 == 0 for d in dims)


def _pad_cols(s: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -s.shape[1] % multiple
    return torch.nn.functional.pad(s, (0, extra)) if extra else s


def _block_mm(a8: torch.Tensor, a_scale: torch.Tensor, b8: torch.Tensor, b_scale: torch.Tensor, b_tiles: bool,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` on Hopper: a (M, K) row-major e4m3 with 1x128 decodes
    ``a_scale`` (M, K/128); b (K, N) column-major e4m3 with 1x128 decodes (N, K/128) or, ``b_tiles``,
    128x128 decodes (N/128, K/128). The kernel's layouts: 1x128 scales outer-dim-major (stride (1, rows)),
    128x128 ones as (round_up(K/128, 4), N/128) with stride (1, that round-up)."""
    from torch.nn.functional import ScalingType, scaled_mm as f_scaled_mm
    sa = a_scale.t().contiguous().t()
    if b_tiles:
        sb = _pad_cols(b_scale, 4).contiguous().t()
        kind_b = ScalingType.BlockWise128x128
    else:
        sb = b_scale.t().contiguous().t()
        kind_b = ScalingType.BlockWise1x128
    return f_scaled_mm(a8, b8, sa, ScalingType.BlockWise1x128, sb, kind_b, output_dtype=out_dtype,
                       use_fast_accum=False)


class BlockedLinearFn(torch.autograd.Function):
    """``x2d @ W^T`` with blocked scaling; the layer (an ``Fp8Linear``) carries the recipe and state.

    Autocast is off inside. Like the per-tensor function, the layer's state changes only in backward
    (amaxes and range counts of the forward's casts are entered there, once per real forward, and the
    stochastic-rounding counter advances there), so evaluation and activation-checkpoint recomputes
    leave it untouched.
    """

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, layer: Any, out_dtype: torch.dtype,
                record: bool) -> torch.Tensor:
        how: BlockedRecipe = layer.blocked
        x_q, x_d = quantize_blocked(x2d, how.input, 1)                        # (M, K): blocks along K
        w_q, w_d = quantize_blocked(weight, how.weight, 1)                    # (N, K): blocks along K
        kernel = layer.backend == "scaled_mm"
        on_cuda = x2d.is_cuda         # the block kernel is Hopper's: elsewhere the GEMM is emulated
        if kernel and how.kernel == "rowwise":
            out = _rowwise_mm(x_q, x_d, w_q, w_d, out_dtype)
        elif kernel and how.kernel == "block" and on_cuda and _block_kernel_fits(*x2d.shape, weight.shape[0]):
            out = _block_mm(x_q.to(torch.float8_e4m3fn), x_d, w_q.to(torch.float8_e4m3fn).t(), w_d, True,
                            out_dtype)
        else:
            w_deq = dequantize_blocked(w_q, w_d, how.weight, 1)
            out = torch.mm(dequantize_blocked(x_q, x_d, how.input, 1), w_deq.t()).to(out_dtype)      # (M, N)
        # Saved for backward: x itself (grad_W re-quantizes it along M) and the weight (grad_x
        # re-quantizes 1-D weight blocks along N); 2-D tiles serve both GEMMs, so their quantized
        # values and decodes are kept instead of quantizing W again.
        need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[0]
        w_keep = (w_q, w_d) if how.weight_tiles else (weight, None)
        a_x = a_w = c_x = c_w = None
        if record:                  # entered into the layer's state by backward, once per real forward
            a_x, a_w = _amax(x2d), _amax(weight)
            if layer.count_ranges:
                c_x, c_w = range_counts(x2d, how.input, 1), range_counts(weight, how.weight, 1)
        ctx.save_for_backward(x2d if need_x else None, w_keep[0] if need_w else None,
                              w_keep[1] if need_w else None, a_x, a_w, c_x, c_w)
        ctx.layer, ctx.x_dtype, ctx.w_dtype, ctx.record = layer, x2d.dtype, weight.dtype, record
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, w_a, w_b, a_x, a_w, c_x, c_w = ctx.saved_tensors
        layer = ctx.layer
        how: BlockedRecipe = layer.blocked
        kernel = layer.backend == "scaled_mm"
        g = grad_out                                                           # (M, N)
        on_cuda = g.is_cuda
        m, n = g.shape
        with torch.autocast(g.device.type, enabled=False):
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:                                        # grad_x = g @ W: over N
                noise = sr_noise(layer.sr_seed, layer.sr_steps, 0, m, n) if how.sr else None
                g_q, g_d = quantize_blocked(g, how.grad_output, 1, noise=noise)       # blocks along N
                if how.weight_tiles:
                    w_q, w_d, w_axis = w_a, w_b, 1          # the forward's tiles: the same along N
                else:
                    w_q, w_d = quantize_blocked(w_a, how.weight, 0)                   # blocks along N
                    w_axis = 0
                k = w_q.shape[1]
                if kernel and how.kernel == "rowwise":
                    # b = W^T (K, N): W's decodes along N are (1, K), one per row of W^T
                    grad_x = _rowwise_mm(g_q, g_d, w_q.t(), w_d, ctx.x_dtype)
                elif kernel and how.kernel == "block" and on_cuda and _block_kernel_fits(m, n, k):
                    w8 = w_q.to(torch.float8_e4m3fn).t().contiguous().t()             # (N, K) column-major
                    grad_x = _block_mm(g_q.to(torch.float8_e4m3fn), g_d, w8, w_d.t(), True, ctx.x_dtype)
                else:
                    w_deq = dequantize_blocked(w_q, w_d, how.weight, w_axis)
                    grad_x = torch.mm(dequantize_blocked(g_q, g_d, how.grad_output, 1), w_deq).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:                                        # grad_W = g^T @ x: over M
                g_m, x_m = g, x2d
                if how.rht:
                    # The same orthogonal H on both sides of the contraction: (H g)^T (H x) = g^T x.
                    g_m = random_hadamard(g.to(torch.float32), layer.rht_signs, 0)
                    x_m = random_hadamard(x2d.to(torch.float32), layer.rht_signs, 0)
                noise = sr_noise(layer.sr_seed, layer.sr_steps, 1, m, n) if how.sr else None
                g_q, g_d = quantize_blocked(g_m, how.grad_output, 0, noise=noise)     # blocks along M
                x_q, x_d = quantize_blocked(x_m, how.input, 0)                        # blocks along M
                k = x_q.shape[1]
                if kernel and how.kernel == "rowwise":
                    grad_w = _rowwise_mm(g_q.t(), g_d, x_q.t(), x_d, ctx.w_dtype)
                elif kernel and how.kernel == "block" and on_cuda and _block_kernel_fits(m, n, k):
                    g8 = g_q.to(torch.float8_e4m3fn).t().contiguous()                 # (N, M) row-major
                    x8 = x_q.to(torch.float8_e4m3fn).t().contiguous().t()             # (M, K) column-major
                    grad_w = _block_mm(g8, g_d.t(), x8, x_d.t(), False, ctx.w_dtype)
                else:
                    g_deq = dequantize_blocked(g_q, g_d, how.grad_output, 0)
                    grad_w = torch.mm(g_deq.t(), dequantize_blocked(x_q, x_d, how.input, 0)).to(ctx.w_dtype)
            counts = (range_counts(g, how.grad_output, 1)
                      if ctx.record and layer.count_ranges else None)
            if ctx.record:
                layer._record_blocked("input", a_x, c_x)
                layer._record_blocked("weight", a_w, c_w)
            layer._record_blocked("grad_output", _amax(g), counts)
            if how.sr:
                layer.sr_steps.add_(1)        # the next backward draws fresh noise
        return grad_x, grad_w, None, None, None


def _amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a 0-d fp32 tensor (NaN if x holds NaN); no host sync."""
    return torch.linalg.vector_norm(x.detach(), float("inf")).to(torch.float32)

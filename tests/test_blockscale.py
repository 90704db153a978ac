"""Tests for mixprec.fp8.blockscale (block-scaled quantizers) and the fp4 e2m1 format.

The references are independent: ml_dtypes casts (float4_e2m1fn, float8_e4m3fn, float8_e5m2,
float8_e8m0fnu), a loop over blocks in numpy (fp32 IEEE division, exact powers of two from Python
floats), and float64 arithmetic for GEMMs and Hadamard products.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mixprec.formats import FP4_E2M1, FP8_E4M3, FP8_E5M2, FP16, Format, get_format, quantize
from mixprec.fp8.blockscale import (
    BlockScaling, _round_magic_, dequantize_blocked, fake_quantize_blocked, quantize_blocked, random_hadamard,
    range_counts, rounding_noise,
)
from mixprec.update.stochastic_rounding import RoundingNoise

ROWWISE = BlockScaling(FP8_E4M3, 0, scale="pow2")
BLOCK_1X128 = BlockScaling(FP8_E4M3, 128, scale="fp32")
BLOCK_128X128 = BlockScaling(FP8_E4M3, 128, 128, scale="fp32")
MXFP8 = BlockScaling(FP8_E4M3, 32, scale="e8m0")
NVFP4 = BlockScaling(FP4_E2M1, 16, scale="e4m3")
NVFP4_2D = BlockScaling(FP4_E2M1, 16, 16, scale="e4m3")
LAYOUTS = {"rowwise": ROWWISE, "1x128": BLOCK_1X128, "128x128": BLOCK_128X128, "mxfp8": MXFP8,
           "nvfp4": NVFP4, "nvfp4_16x16": NVFP4_2D, "e5m2_1x32_pow2": BlockScaling(FP8_E5M2, 32, scale="pow2")}
NAN, INF = float("nan"), float("inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ml_round(y: np.ndarray, fmt: Format) -> np.ndarray:
    """float32 -> fmt -> float32 through ml_dtypes, saturating (clip first: ml_dtypes' fp8 casts do not)."""
    y = np.asarray(y, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.clip(y, -fmt.max, fmt.max).astype(fmt.numpy_dtype).astype(np.float32)


def grid(fmt: Format) -> np.ndarray:
    """Every finite value of fmt, sorted (both signs, one zero)."""
    n = 2**fmt.bits
    with np.errstate(invalid="ignore"):
        v = np.arange(n, dtype=np.uint8).view(fmt.numpy_dtype).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """float32 arrays equal bit for bit, NaN matching any NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    return a.shape == b.shape and bool(np.array_equal(nan, np.isnan(b))) and \
        bool(np.array_equal(a[~nan].view(np.int32), b[~nan].view(np.int32)))


# ---------------------------------------------------------------------------- reference quantizer

def _pow2_ceil_exact(a: float, top: float) -> float:
    """The least 2**k with a <= top * 2**k (Python floats: powers of two times top are exact)."""
    k = math.ceil(math.log2(a / top))
    while top * 2.0**k < a:
        k += 1
    while top * 2.0 ** (k - 1) >= a:
        k -= 1
    return 2.0**k


def ref_decode(amax: np.ndarray, how: BlockScaling) -> np.ndarray:
    top = np.float32(how.elem.max)
    finite = np.isfinite(amax)
    if how.scale == "e4m3":
        amax_t = np.float32(amax[finite].max()) if finite.any() else np.float32(0)
        t = max(amax_t / np.float32(top * 448), np.float32(2.0**-126)) if amax_t > 0 else np.float32(1)
        a = np.where(finite, amax, 0).astype(np.float32)
        code = ml_round(np.minimum(a / top / t, 448), FP8_E4M3)
        d = (code * t).astype(np.float32)
    elif how.scale == "fp32":
        d = np.maximum(amax / top, np.float32(2.0**-126)).astype(np.float32)
    else:
        lo, hi = (2.0**-127, 2.0**127) if how.scale == "e8m0" else (2.0**-126, 2.0**127)
        d = np.array([min(max(_pow2_ceil_exact(float(a), float(top)), lo), hi) if a > 0 and np.isfinite(a)
                      else 1.0 for a in amax.ravel()], dtype=np.float32).reshape(amax.shape)
    if how.scale != "e4m3":
        d = np.where(amax == 0, np.float32(1), d)
    return np.where(finite, d, np.float32(np.nan)).astype(np.float32)


def ref_quantize(x: np.ndarray, how: BlockScaling, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """A loop over blocks: amax, decode, x / decode in fp32, then ml_dtypes' rounding."""
    x = np.asarray(x, np.float32)
    t0, t1 = how.tile(axis)
    t0, t1 = t0 or x.shape[0], t1 or x.shape[1]
    n0, n1 = -(-x.shape[0] // t0), -(-x.shape[1] // t1)
    amax = np.zeros((n0, n1), np.float32)
    for i in range(n0):
        for j in range(n1):
            amax[i, j] = np.max(np.abs(x[i * t0:(i + 1) * t0, j * t1:(j + 1) * t1]))   # NaN propagates
    d = ref_decode(amax, how)
    q = np.empty_like(x)
    for i in range(n0):
        for j in range(n1):
            blk = x[i * t0:(i + 1) * t0, j * t1:(j + 1) * t1]
            with np.errstate(invalid="ignore"):
                y = blk * np.float32(0) if d[i, j] == 0 else blk / d[i, j]   # a flushed block keeps signs
            q[i * t0:(i + 1) * t0, j * t1:(j + 1) * t1] = ml_round(y, how.elem)
    return q, d


def _data(shape, seed=0, spread=True) -> torch.Tensor:
    """Normal values with a per-element magnitude spread over many binades (blocks see real dynamic range)."""
    g = _gen(seed)
    x = torch.randn(shape, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-12, 13, shape, generator=g).float())
    return x


# ---------------------------------------------------------------------------- fp4 e2m1 format

def test_fp4_constants_match_ml_dtypes():
    fi = ml_dtypes.finfo(ml_dtypes.float4_e2m1fn)
    f = FP4_E2M1
    assert (f.max, f.min_normal, f.min_subnormal, f.eps) == (6.0, 1.0, 0.5, 0.5)
    assert (f.max, f.min_normal, f.min_subnormal, f.eps) == tuple(
        float(v) for v in (fi.max, fi.smallest_normal, fi.smallest_subnormal, fi.eps))
    assert (f.bits, f.exponent_bits, f.mantissa_bits) == (4, 2, 1)
    assert (f.has_inf, f.has_nan, f.torch_dtype) == (False, False, None)
    assert get_format("e2m1") is get_format("fp4_e2m1") is get_format("float4_e2m1fn") is f
    assert (FP8_E4M3.max, FP8_E5M2.max, FP16.max) == (448.0, 57344.0, 65504.0)   # has_nan changed nothing


def _e2m1_inputs() -> np.ndarray:
    """All 16 codes, every midpoint (ties), their fp32 neighbours, values past 6, both signs."""
    g = grid(FP4_E2M1)
    pos = g[g >= 0]
    mids = (pos[:-1] + pos[1:]) / 2                  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
    pts = np.concatenate([pos, mids, [6.5, 7.0, 8.0, 1e30, 2.0**-149, 0.1]]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    return np.concatenate([pts, -pts]).astype(np.float32)


def test_fp4_quantize_matches_ml_dtypes_value_for_value():
    x = _e2m1_inputs()
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)    # ml_dtypes saturates finite values
    assert same_bits(quantize(torch.from_numpy(x), FP4_E2M1, saturate=True).numpy(), want)
    # Hand-worked ties (to even): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25])
    got = quantize(ties, FP4_E2M1, saturate=True)
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0]
    assert got[-1].view(torch.int32).item() == -(2**31)                # -0.25 -> -0, sign kept


def test_fp4_nan_policy_and_overflow():
    # e2m1 has no inf and no NaN: the fp32 holder marks "not representable" with NaN. ml_dtypes differs
    # there (inf -> 6, NaN -> 0), which is why inf/NaN are not in the value-for-value set above.
    x = torch.tensor([INF, -INF, NAN, 7.0, 6.9, -1e9])
    assert np.isnan(quantize(x, FP4_E2M1, saturate=True)[:3].numpy()).all()
    assert quantize(x, FP4_E2M1, saturate=True)[3:].tolist() == [6.0, 6.0, -6.0]
    # without saturation: 7 is the tie above 6 (odd) and rounds up out of range; 6.9 rounds to 6
    assert np.isnan(quantize(x[3:4], FP4_E2M1).numpy()).all() and quantize(x[4:5], FP4_E2M1).item() == 6.0


def test_quantize_blocked_e2m1_elements_value_for_value():
    # Each row [6, v] is one block with pow2 decode 1 (amax 6), so q[:, 1] is v rounded to e2m1 itself.
    v = _e2m1_inputs()
    v = v[np.abs(v) <= 6]
    x = torch.stack([torch.full((v.size,), 6.0), torch.from_numpy(v)], dim=1)
    q, d = quantize_blocked(x, BlockScaling(FP4_E2M1, 0, scale="pow2"), 1)
    assert d.eq(1).all() and same_bits(q[:, 1].numpy(), ml_round(v, FP4_E2M1))
    assert q[:, 1].view(torch.int32).lt(0).sum() == (v.view(np.int32) < 0).sum()    # -0 stays -0


@pytest.mark.parametrize("fmt", [FP4_E2M1, FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
def test_magic_rounding_matches_ml_dtypes(fmt):
    # The fp32 add-and-subtract rounding (e2m1 everywhere, fp8 off CPU/CUDA) on random bit patterns.
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x[np.isfinite(x)], _e2m1_inputs(), grid(fmt).astype(np.float32)])
    x = np.clip(x, -fmt.max, fmt.max).astype(np.float32)
    got = _round_magic_(torch.from_numpy(x.copy()), fmt).numpy()
    assert same_bits(got, ml_round(x, fmt))


# ---------------------------------------------------------------------------- layouts vs the reference

SHAPES = [(64, 256), (37, 50), (133, 67), (1, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quantize_matches_block_loop_reference(layout, axis, shape):
    how = LAYOUTS[layout]
    x = _data(shape, seed=sum(shape) + axis)
    q, d = quantize_blocked(x, how, axis)
    q_ref, d_ref = ref_quantize(x.numpy(), how, axis)
    assert q.dtype == d.dtype == torch.float32 and q.shape == x.shape
    assert same_bits(d.numpy(), d_ref), (d, d_ref)
    assert same_bits(q.numpy(), q_ref)
    assert (q.abs() <= how.elem.max).all()


def test_decode_shapes():
    x = torch.randn(300, 200)
    want = {("rowwise", 1): (300, 1), ("rowwise", 0): (1, 200), ("1x128", 1): (300, 2), ("1x128", 0): (3, 200),
            ("128x128", 1): (3, 2), ("128x128", 0): (3, 2), ("mxfp8", 1): (300, 7), ("mxfp8", 0): (10, 200),
            ("nvfp4", 1): (300, 13), ("nvfp4", 0): (19, 200), ("nvfp4_16x16", 0): (19, 13)}
    for (layout, axis), shape in want.items():
        q, d = quantize_blocked(x, LAYOUTS[layout], axis)
        assert q.shape == x.shape and tuple(d.shape) == shape, (layout, axis, tuple(d.shape))
    assert MXFP8.tile(1) == (1, 32) and MXFP8.tile(0) == (32, 1) and BLOCK_128X128.tile(0) == (128, 128)


def test_ragged_tail_is_its_own_partial_block():
    # 20 columns in blocks of 16: the last block holds columns 16..19 only, scaled by their own amax.
    x = torch.full((1, 20), 0.01)
    x[0, 0], x[0, 19] = 6.0, 3.0
    q, d = quantize_blocked(x, BlockScaling(FP4_E2M1, 16, scale="pow2"), 1)
    assert d.tolist() == [[1.0, 0.5]]                        # 6/6 -> 1; 3/6 = 0.5 -> 0.5
    assert q[0, 16:].tolist() == [0.0, 0.0, 0.0, 6.0]         # 0.01/0.5 = 0.02 -> 0; 3/0.5 = 6


def test_fp32_input_kinds_agree():
    x = _data((32, 64), seed=3)
    for how in (MXFP8, NVFP4):
        q32, d32 = quantize_blocked(x, how, 1)
        qb, db = quantize_blocked(x.bfloat16(), how, 1)
        qb_ref, db_ref = quantize_blocked(x.bfloat16().float(), how, 1)
        assert torch.equal(qb, qb_ref) and torch.equal(db, db_ref)
        q64, d64 = quantize_blocked(x.double(), how, 1)       # float64 is rounded to fp32 first
        assert torch.equal(q64, q32) and torch.equal(d64, d32)
    before = x.clone()
    for how in LAYOUTS.values():                              # the input is never written to
        fake_quantize_blocked(x, how, 0, noise=torch.zeros(x.shape, dtype=torch.int32))
        range_counts(x, how, 1)
    assert torch.equal(x, before)


def test_fp8_dtype_output_holds_the_same_values():
    x = _data((16, 256), seed=4)
    for how in (ROWWISE, BLOCK_1X128, MXFP8):
        q, d = quantize_blocked(x, how, 1)
        q8, d8 = quantize_blocked(x, how, 1, dtype=torch.float8_e4m3fn)
        assert q8.dtype == torch.float8_e4m3fn and torch.equal(q8.float(), q) and torch.equal(d8, d)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quantize_blocked(x, MXFP8, 1, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- scale encodings

def test_e8m0_decodes_are_powers_of_two_that_never_saturate():
    x = _data((64, 256), seed=5)
    x[3, :32] *= 2.0**60                                     # amaxes far apart across blocks
    x[4, :32] *= 2.0**-100
    q, d = quantize_blocked(x, MXFP8, 1)
    amax = x.abs().reshape(64, 8, 32).amax(-1)
    # each decode is an e8m0 value (round trip through ml_dtypes' float8_e8m0fnu is exact) ...
    dn = d.numpy()
    assert same_bits(dn.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), dn)
    # ... the least power of two that fits the block's amax under 448: amax / d in (224, 448]
    ratio = (amax / d).double()
    assert (ratio <= 448).all() and (ratio > 224).all()
    assert (q.abs() <= 448).all()
    code = dn.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).astype(np.int64)
    assert np.array_equal(code - 127, np.log2(dn).astype(np.int64))    # the stored exponent byte


def test_e8m0_edges_zero_tiny_huge_and_nonfinite():
    x = torch.zeros(6, 32)
    x[1, 0] = 448.0                          # exactly 448 * 2**0 -> d = 1, q = 448 (no rounding up)
    x[2, 0] = 448.0 * (1 + 2**-23)           # just above -> d = 2
    x[3, 0] = 1e-42                          # below 448 * 2**-127 -> d clamps at e8m0's least, 2**-127
    x[4, 0] = 3.0e38                         # near fp32 max: 2**120 still fits e8m0
    x[5, 0], x[5, 1] = INF, 1.0
    q, d = quantize_blocked(x, MXFP8, 1)
    assert d[:5, 0].tolist() == [1.0, 1.0, 2.0, 2.0**-127, 2.0**120]  # row 0: a zero block -> 1
    assert q[1, 0] == 448.0 and q[0].eq(0).all()
    assert math.isnan(d[5, 0]) and q[5].isnan().all()      # an inf anywhere: the whole block is NaN
    x[5, 0] = NAN
    q, d = quantize_blocked(x, MXFP8, 1)
    assert math.isnan(d[5, 0]) and q[5].isnan().all() and not q[:5].isnan().any()


def test_nvfp4_e4m3_block_scales_hand_worked():
    # Block A: amax 6 = the tensor's amax -> t = 6 / 2688, code 448. Block B: amax 0.6 -> code e4m3(44.8) = 44.
    x = torch.zeros(1, 48)
    x[0, 0], x[0, 16], x[0, 17] = 6.0, 0.6, -0.3
    q, d = quantize_blocked(x, NVFP4, 1)
    t = np.float32(6.0) / np.float32(2688.0)
    assert d[0, 0].item() == np.float32(448 * t) and d[0, 1].item() == np.float32(44 * t)
    assert d[0, 2].item() == 0.0 and q[0, 32:].eq(0).all()           # zero block: code 0
    assert q[0, 0] == 6.0 and q[0, 16] == 6.0 and q[0, 17] == -3.0   # 0.6/d = 6.1 -> 6; -0.3/d = -3.05 -> -3
    # on random data too, every decode is fl(c * t) for an e4m3 value c (d / t is within an ulp of c)
    x = _data((8, 64), seed=25)
    _, d = quantize_blocked(x, NVFP4, 1)
    t = np.float32(x.abs().max().item()) / np.float32(2688.0)
    codes = ml_round(d.numpy() / t, FP8_E4M3)
    assert same_bits((codes * t).astype(np.float32), d.numpy()) and (codes > 0).all()


def test_nvfp4_code_underflow_flushes_and_nonfinite_block_is_ignored_by_tensor_scale():
    x = _data((4, 64), seed=6, spread=False)
    x[1, 16:32] = 1e-9                          # amax_b / amax_t ~ 1e-9: its e4m3 code underflows to 0
    x[2, 32] = INF
    q, d = quantize_blocked(x, NVFP4, 1)
    assert d[1, 1] == 0 and q[1, 16:32].eq(0).all()
    assert math.isnan(d[2, 2]) and q[2, 32:48].isnan().all() and q[2, 48:].isfinite().all()
    clean = x.clone()
    clean[2, 32] = 0.0
    _, d_clean = quantize_blocked(clean, NVFP4, 1)
    keep = torch.ones_like(d, dtype=torch.bool)
    keep[2, 2] = False
    assert torch.equal(d[keep], d_clean[keep])   # the inf block did not move the tensor scale
    assert range_counts(x, NVFP4, 1).tolist()[0] >= 16


def test_fp32_and_pow2_decodes():
    x = _data((8, 256), seed=7)
    q, d = quantize_blocked(x, BLOCK_1X128, 1)
    amax = x.abs().reshape(8, 2, 128).amax(-1)
    assert torch.equal(d, amax / 448)                                  # one fp32 division
    _, d2 = quantize_blocked(x, ROWWISE, 1)
    m, _ = torch.frexp(d2)
    assert (m == 0.5).all() and (x.abs().amax(1, keepdim=True) / d2 <= 448).all()
    assert torch.equal(quantize_blocked(torch.zeros(2, 4), ROWWISE, 1)[1], torch.ones(2, 1))


# ---------------------------------------------------------------------------- dequantize, GEMM

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dequantize_is_one_rounding_and_fake_quantize_agrees(layout):
    how = LAYOUTS[layout]
    x = _data((37, 150), seed=8)
    for axis in (0, 1):
        q, d = quantize_blocked(x, how, axis)
        deq = dequantize_blocked(q, d, how, axis)
        t0, t1 = how.tile(axis)
        t0, t1 = t0 or 37, t1 or 150
        d_full = d.double().repeat_interleave(t0, 0)[:37].repeat_interleave(t1, 1)[:, :150]
        assert torch.equal(deq, (q.double() * d_full).float())          # exact product, rounded once
        assert torch.equal(fake_quantize_blocked(x, how, axis), deq)
        if how.scale in ("pow2", "e8m0"):
            assert torch.equal(deq.double(), q.double() * d_full)       # no rounding at all


@pytest.mark.parametrize("layout", ["rowwise", "1x128", "128x128", "mxfp8", "nvfp4"])
def test_emulated_gemm_matches_float64_of_the_dequantized_operands(layout):
    how = LAYOUTS[layout]
    a, b = _data((64, 384), seed=9, spread=False), _data((48, 384), seed=10, spread=False)
    # forward: x (M, K) and W (N, K) both blocked along K; grad_W: g^T x, both blocked along M (axis 0)
    for axis, (lhs, rhs) in ((1, (a, b)), (0, (a.t().contiguous(), b.t().contiguous()))):
        da = fake_quantize_blocked(lhs, how, axis)
        db = fake_quantize_blocked(rhs, how, axis)
        assert not torch.equal(da, lhs) and not torch.equal(db, rhs)    # it did quantize
        if axis == 0:                                                   # contract over rows
            da, db = da.t(), db.t()
        got, want = da @ db.t(), da.double() @ db.double().t()
        # fp32 accumulation of k products: |error| <= k * 2**-24 * sum |a_i b_i| (a textbook bound)
        bound = da.double().abs() @ db.double().abs().t()
        assert ((got.double() - want).abs() <= da.shape[1] * 2.0**-24 * bound).all()


def _sqnr_db(x: torch.Tensor, xq: torch.Tensor) -> float:
    x64 = x.double()
    return 10 * math.log10(x64.square().sum() / (x64 - xq.double()).square().sum())


def _ideal_sqnr_db(x: torch.Tensor, fmt: Format) -> float:
    """SQNR of rounding each value to fmt's relative grid (no range limits): step 2**(floor(log2|x|) - m),
    error uniform over a step (variance step**2 / 12)."""
    x64 = x.double()
    step = torch.exp2(torch.floor(torch.log2(x64.abs())) - fmt.mantissa_bits)
    return 10 * math.log10(x64.square().sum() / (step.square().sum() / 12))


def test_sqnr_of_normal_data_per_layout():
    x = torch.randn(512, 1024, generator=_gen(11))
    ideal_e4m3 = _ideal_sqnr_db(x, FP8_E4M3)                            # ~31.5 dB
    got = {name: _sqnr_db(x, fake_quantize_blocked(x, LAYOUTS[name], 1)) for name in LAYOUTS}
    for name in ("rowwise", "1x128", "128x128", "mxfp8"):               # 1x32 e8m0 and the rest: ~ideal
        assert abs(got[name] - ideal_e4m3) < 1.0, (name, got[name], ideal_e4m3)
    assert got["mxfp8"] >= 25.0 and got["nvfp4"] >= 10.0 and got["nvfp4_16x16"] >= 10.0
    assert abs(got["e5m2_1x32_pow2"] - _ideal_sqnr_db(x, FP8_E5M2)) < 1.0
    assert got["nvfp4"] > got["nvfp4_16x16"]                            # finer blocks fit better


# ---------------------------------------------------------------------------- stochastic rounding

def test_stochastic_rounding_is_exactly_unbiased_over_all_noise_values():
    # Every row is one block whose amax is 6 (pow2 decode 1): q is x rounded on the e2m1 grid. Row i
    # gets noise i, so each column sees all 2**16 noise values: its mean is x exactly when x's fraction
    # of a grid step is a multiple of 2**-16.
    vals = torch.tensor([6.0, 0.1 + 2**-18, -0.3, 0.75, 1.2, -1.9, 2.7, -3.3, 4.9, 5.5, 0.0, 2**-17,
                         -5.999, 1.0, 3.25, -4.5]).double()
    step = torch.where(vals.abs() < 2, 0.5, torch.where(vals.abs() < 4, 1.0, 2.0))
    vals = (torch.round(vals / step * 2**16) / 2**16 * step).float()   # fractions on the 2**-16 lattice
    x = vals.repeat(2**16, 1)                                            # (65536, 16)
    noise = torch.arange(2**16, dtype=torch.int32)[:, None].expand(-1, 16).contiguous()
    q, d = quantize_blocked(x, BlockScaling(FP4_E2M1, 16, scale="pow2"), 1, noise=noise)
    assert d.eq(1).all()
    assert torch.equal(q.double().mean(0), vals.double())
    lo = torch.from_numpy(ml_round(np.floor(vals.numpy() / step.float().numpy()) * step.float().numpy(), FP4_E2M1))
    assert ((q == lo) | (q == lo + step.float())).all()                # always a grid neighbour


def test_stochastic_rounding_unbiased_statistically_with_rounding_noise():
    # nvfp4 (e4m3 block scales) on random values, noise from RoundingNoise: the column mean of
    # N draws is within 5 standard deviations (Bernoulli: p(1-p) step**2 / N) plus the 2**-16 bias.
    n = 4096
    row = _data((1, 64), seed=12, spread=False) * 3
    x = row.repeat(n, 1)
    src = RoundingNoise(seed=7, numel=x.numel(), device="cpu")
    q, d = quantize_blocked(x, NVFP4, 1, noise=rounding_noise(src, x.shape))
    y = (x / d.repeat_interleave(16, 1))[0].double().clamp(-6, 6)      # x / decode, saturated
    g = torch.from_numpy(grid(FP4_E2M1))
    hi = g[torch.searchsorted(g, y)]
    lo = g[torch.searchsorted(g, y, right=True) - 1]
    step = hi - lo
    p = torch.where(step > 0, (y - lo) / step.clamp(min=1e-30), 0)
    tol = 5 * torch.sqrt(p * (1 - p) / n) * step + step * 2.0**-16 + 1e-12
    mean = q.double().mean(0)
    assert ((mean - y).abs() <= tol).all(), (mean - y).abs().max()
    assert (((q == lo.float()) | (q == hi.float())).all())
    # the same noise gives the same q; the next step's noise gives a different one
    assert torch.equal(q, quantize_blocked(x, NVFP4, 1, noise=rounding_noise(src, x.shape))[0])
    src.advance()
    assert not torch.equal(q, quantize_blocked(x, NVFP4, 1, noise=rounding_noise(src, x.shape))[0])


def test_stochastic_rounding_never_leaves_the_grid():
    x = _data((64, 256), seed=13) * 1e3
    noise = torch.randint(-2**31, 2**31 - 1, x.shape, dtype=torch.int32, generator=_gen(14))
    for how in (NVFP4, NVFP4_2D, MXFP8):
        q, d = quantize_blocked(x, how, 0, noise=noise)
        g = torch.from_numpy(grid(how.elem)).float()
        assert torch.isin(q, g).all() and (q.abs() <= how.elem.max).all()
        rne, _ = quantize_blocked(x, how, 0)
        assert (q - rne).abs().max() > 0                                 # it did round differently
    # full 32-bit noise and its low 16 bits give the same result
    assert torch.equal(quantize_blocked(x, NVFP4, 1, noise=noise)[0],
                       quantize_blocked(x, NVFP4, 1, noise=noise & 0xFFFF)[0])


def test_rounding_noise_helper():
    src = RoundingNoise(seed=1, numel=1000, device="cpu")
    n = rounding_noise(src, (10, 20), start=5)
    flat = torch.empty(200, dtype=torch.int32)
    src.fill_(flat, 5, src.tables())
    assert n.dtype == torch.int32 and n.shape == (10, 20) and torch.equal(n.reshape(-1), flat)
    assert n.min() >= 0 and n.max() < 2**16
    with pytest.raises(ValueError, match="numel >= 1005"):
        rounding_noise(src, (50, 20), start=5)


# ---------------------------------------------------------------------------- random Hadamard

def test_hadamard_matrix_is_exactly_orthogonal():
    signs = torch.tensor([1.0, -1.0] * 8)[torch.randperm(16, generator=_gen(15))]
    m = random_hadamard(torch.eye(16), signs, 1)                        # rows of I times M: M itself
    assert torch.equal(m.t() @ m, torch.eye(16))
    assert set(m.abs().unique().tolist()) == {0.25}
    assert torch.equal(random_hadamard(torch.eye(16), signs, 0), m.t())  # columns: v -> v M as well


def test_hadamard_preserves_dot_products_along_the_axis():
    signs = 1 - 2 * torch.randint(0, 2, (16,), generator=_gen(16)).double()
    a, b = torch.randn(64, 40, generator=_gen(17)).double(), torch.randn(64, 30, generator=_gen(18)).double()
    ha, hb = random_hadamard(a, signs, 0), random_hadamard(b, signs, 0)
    assert torch.allclose(ha.t() @ hb, a.t() @ b, rtol=0, atol=1e-12)     # grad_W = g^T x under RHT
    assert not torch.allclose(ha, a)
    a32, b32 = a.float(), torch.randn(30, 64, generator=_gen(19))
    h = random_hadamard(a32.t().contiguous(), signs.float(), 1) @ random_hadamard(b32, signs.float(), 1).t()
    assert torch.allclose(h, a32.t() @ b32.t(), rtol=0, atol=1e-4) and h.dtype == torch.float32


def test_hadamard_ragged_tail_untouched_and_bad_signs():
    x = torch.randn(3, 20, generator=_gen(20))
    out = random_hadamard(x, torch.ones(16), 1)
    assert torch.equal(out[:, 16:], x[:, 16:]) and torch.allclose(out.norm(dim=1), x.norm(dim=1))
    with pytest.raises(ValueError, match="16 values"):
        random_hadamard(x, torch.ones(8), 1)


# ---------------------------------------------------------------------------- range counts

def test_range_counts_hand_worked():
    # rowwise e4m3, pow2: amax 448 -> d = 1; 1e-3 * 2**-10 rounds to 0 (flushed); 0 is not a flush
    x = torch.tensor([[448.0, 1e-3 * 2**-10, 0.0, 1.0]])
    assert range_counts(x, ROWWISE, 1).tolist() == [1, 0, 4]
    # nvfp4: block B's code 1.4 * 2**-9 rounds to the subnormal 2**-9, so 6 * 1.4 = 8.4 >= 7 saturates
    x = torch.zeros(1, 48)
    x[0, 0] = 2688.0                                    # t = 1, code 448
    x[0, 16] = 6 * 1.4 * 2.0**-9
    x[0, 17] = 1e-4                                     # 1e-4 / 2**-9 = 0.05 -> 0: flushed
    assert range_counts(x, NVFP4, 1).tolist() == [1, 1, 48]
    x[0, 32], x[0, 33] = NAN, 1e-30                     # a NaN block counts nowhere
    assert range_counts(x, NVFP4, 1).tolist() == [1, 1, 48]


@pytest.mark.parametrize("layout", ["rowwise", "mxfp8", "nvfp4", "e5m2_1x32_pow2"])
def test_range_counts_match_brute_force(layout):
    how = LAYOUTS[layout]
    x = _data((40, 96), seed=21) * torch.exp2(torch.randint(-30, 1, (40, 96), generator=_gen(22)).float())
    q, d = quantize_blocked(x, how, 1)
    t1 = how.block or 96
    y = x / d.repeat_interleave(t1, 1)[:, :96]
    flushed = ((x != 0) & (q == 0)).sum().item()
    saturated = (y.isfinite() & ~(quantize(y, how.elem).abs() <= how.elem.max)).sum().item()
    assert range_counts(x, how, 1).tolist() == [flushed, saturated, x.numel()]
    assert flushed > 0


# ---------------------------------------------------------------------------- API edges

def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="fp8_e4m3, fp8_e5m2, fp4_e2m1"):
        BlockScaling(FP16, 16)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="block must be an int"):
            BlockScaling(FP8_E4M3, bad)
    with pytest.raises(ValueError, match="block_rows"):
        BlockScaling(FP8_E4M3, 16, 0)
    with pytest.raises(ValueError, match="fp32, pow2, e8m0, e4m3"):
        BlockScaling(FP8_E4M3, 16, scale="fp16")
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="axis must be 0 or 1"):
        quantize_blocked(x, MXFP8, 2)
    with pytest.raises(ValueError, match="2-D"):
        quantize_blocked(x[None], MXFP8, 1)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_blocked(x.int(), MXFP8, 1)
    with pytest.raises(ValueError, match="noise must be int32"):
        quantize_blocked(x, NVFP4, 1, noise=torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="noise must be int32"):
        quantize_blocked(x, NVFP4, 1, noise=torch.zeros(4, 32))
    q, d = quantize_blocked(x, MXFP8, 1)
    with pytest.raises(ValueError, match=r"needs \(4, 2\)"):
        dequantize_blocked(q, d, BlockScaling(FP8_E4M3, 16), 1)


def test_no_host_sync():
    # meta tensors carry no data: any .item() or data-dependent branch would fail here
    x = torch.empty(64, 48, device="meta")
    for how in LAYOUTS.values():
        q, d = quantize_blocked(x, how, 0, noise=torch.empty(64, 48, dtype=torch.int32, device="meta"))
        assert q.device.type == "meta" and q.shape == (64, 48)
    assert range_counts(x, NVFP4, 1).device.type == "meta"


@pytest.mark.slow
def test_traces_without_graph_breaks():
    # dynamo traces the whole quantizer as one graph (the eager backend: no compiler needed, ~10 s)
    def f(a, n):
        return fake_quantize_blocked(random_hadamard(a, torch.ones(16), 0), NVFP4, 0, noise=n)

    fn = torch.compile(f, backend="eager", fullgraph=True)
    a = torch.randn(32, 48, generator=_gen(23))
    n = torch.randint(0, 2**16, (32, 48), dtype=torch.int32, generator=_gen(24))
    assert torch.equal(fn(a, n), f(a, n))


@pytest.mark.parametrize("axis", [0, 1])
def test_mxfp8_equals_rowwise_except_where_rowwise_goes_subnormal(axis):
    # Issue 35: both scales are powers of two, and rounding a normal value to e4m3's 3 mantissa bits
    # does not depend on its exponent, so q * d is the same number under either scale for every element
    # that is normal under both; they can differ only below e4m3's smallest normal (2**-6) times the
    # scale, where the larger rowwise scale leaves fewer bits. So mxfp8 is never less precise than
    # rowwise element by element: worked here on heavy-tailed data with a 2**40 spread inside a row.
    g = torch.Generator().manual_seed(35)
    x = torch.randn(256, 320, generator=g) * torch.exp2(torch.randint(-20, 21, (256, 320), generator=g).float())
    row, mx = fake_quantize_blocked(x, ROWWISE, axis), fake_quantize_blocked(x, MXFP8, axis)
    _, d_row = quantize_blocked(x, ROWWISE, axis)
    d_row = d_row.expand_as(x)                             # (256, 1) or (1, 320): one per row/column
    normal = x.abs() >= 2.0**-6 * d_row                    # normal in e4m3 under the row's scale
    assert torch.equal(row[normal], mx[normal])
    assert normal.float().mean() > 0.2                     # the comparison covers a real share
    err_row, err_mx = (row - x).abs(), (mx - x).abs()
    assert (err_mx <= err_row).all()                       # never worse, element by element
    assert (err_mx < err_row).any()                        # and better where rowwise went subnormal


def _negative_zeros(t: torch.Tensor) -> int:
    return int((torch.signbit(t) & (t == 0)).sum())


@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_an_all_zero_nvfp4_block_decodes_to_plus_zero(role, axis, stochastic):
    # An all-zero tile's max(hi, -lo) was -0 (torch.maximum(+0, -0)), so nvfp4's e4m3 code and decode
    # were -0 and the block's +0 values decoded to -0.0; fp32's 0 * scale is +0.
    from mixprec.fp8 import Fp8Config
    from mixprec.fp8.blocked_linear import blocked_recipe
    how = getattr(blocked_recipe(Fp8Config.parse("nvfp4")), role)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 64, generator=g)
    x[:, :16] = 0.0                          # whole 16-blocks along dim 1 and whole 16x16 tiles
    x[:16, :] = 0.0                          # whole blocks along dim 0
    zero = x == 0
    signs = torch.tensor([1.0, -1.0] * 8)
    for operand in (x, random_hadamard(x, signs, axis)):     # the gradient casts transform first
        noise = (torch.randint(0, 2**16, x.shape, generator=g, dtype=torch.int32) if stochastic else None)
        q, d = quantize_blocked(operand, how, axis, noise=noise)
        assert _negative_zeros(d) == 0 and (d == 0).any()       # zero blocks: code 0, decode +0
        deq = dequantize_blocked(q, d, how, axis)
        fake = fake_quantize_blocked(operand, how, axis, noise=noise)
        assert torch.equal(deq, fake)
        assert _negative_zeros(deq[zero]) == 0 and _negative_zeros(fake[zero]) == 0
        assert bool((deq[zero] == 0).all())
    # A block of -0.0 keeps its sign, as fp32's (-0) * scale does.
    neg = torch.full((16, 16), -0.0)
    q, d = quantize_blocked(neg, how, axis)
    assert _negative_zeros(dequantize_blocked(q, d, how, axis)) == neg.numel() and _negative_zeros(d) == 0


@pytest.mark.parametrize("scale", ["fp32", "pow2", "e8m0"])
def test_a_zero_block_of_the_other_scales_gets_decode_one(scale):
    q, d = quantize_blocked(torch.zeros(4, 64), BlockScaling(FP8_E4M3, 32, scale=scale), 1)
    assert torch.equal(d, torch.ones(4, 2)) and _negative_zeros(q) == 0

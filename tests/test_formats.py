"""Tests for mixprec.formats: constants, exact rounding, range classification.

Two independent references for ``quantize``: ml_dtypes casts (fp16, bf16, fp8) and
exact float64 arithmetic (``np.rint`` of x / quantum, for every format incl. tf32).
Results are compared bit for bit; NaNs only have to be NaN on both sides.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.formats import (
    BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, TF32,
    Format, RangeCounts, classify, get_format, quantize,
)

ALL_FORMATS = list(FORMATS.values())
ML_FORMATS = [FP16, BF16, FP8_E4M3, FP8_E5M2]  # formats ml_dtypes can cast to
ids = lambda f: f.name  # noqa: E731


# ----------------------------------------------------------------------------- references

def ml_reference(x: np.ndarray, fmt: Format, saturate: bool = False) -> np.ndarray:
    """float32 -> fmt -> float32 through ml_dtypes/numpy casts (which never saturate)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if saturate:  # clamping finite values to ±max first is exactly a saturating cast
            x = np.where(np.isfinite(x), np.clip(x, -fmt.max, fmt.max), x).astype(np.float32)
        return x.astype(fmt.numpy_dtype).astype(np.float32)


def f64_reference(x: np.ndarray, fmt: Format, saturate: bool = False) -> np.ndarray:
    """Round with exact float64 arithmetic: the quantum is 2**(max(floor(log2|x|), emin) - m)."""
    with np.errstate(invalid="ignore"):  # signalling-NaN patterns warn when widened
        x64 = x.astype(np.float64)
    finite = np.isfinite(x64)
    _, e = np.frexp(np.where(finite, x64, 1.0))  # |x| = f * 2**e with f in [0.5, 1)
    q_exp = np.maximum(e - 1, fmt.min_exponent) - fmt.mantissa_bits
    r = np.ldexp(np.rint(np.ldexp(x64, -q_exp)), q_exp)  # rint: ties to even; all exact in f64
    over_value = fmt.max if saturate else (np.inf if fmt.has_inf else np.nan)
    r = np.where(finite & (np.abs(r) > fmt.max), np.copysign(over_value, x64), r)
    # Non-finite input: NaN stays NaN, inf stays inf unless the format has none (e4m3fn).
    r = np.where(finite, r, x64 if fmt.has_inf else np.nan)
    return r.astype(np.float32)


def assert_same_bits(actual: torch.Tensor, expected: np.ndarray, x: np.ndarray) -> None:
    """Bit-for-bit equality as int32 patterns, except that NaN only has to match NaN."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    got = actual.numpy()
    nan_got, nan_want = np.isnan(got), np.isnan(expected)
    bad = (nan_got != nan_want) | (~nan_got & (got.view(np.int32) != expected.view(np.int32)))
    if bad.any():
        i = np.flatnonzero(bad)[:8]
        raise AssertionError(
            f"{int(bad.sum())} of {x.size} differ, e.g. x={x[i].tolist()} "
            f"(bits {[hex(b) for b in x.view(np.uint32)[i]]}) got={got[i].tolist()} want={expected[i].tolist()}"
        )


# ----------------------------------------------------------------------------- inputs

def _all_patterns(dtype, nbits: int) -> np.ndarray:
    """Every bit pattern of an ml_dtypes/numpy format, decoded to float32."""
    uint = np.uint16 if nbits == 16 else np.uint8
    return np.arange(2**nbits, dtype=np.uint32).astype(uint).view(dtype).astype(np.float32)


def _grid(fmt: Format) -> np.ndarray:
    """Sorted non-negative finite values of fmt (tf32: a few binades), plus max + top ulp."""
    if fmt.numpy_dtype is not None and fmt is not FP32:
        with np.errstate(invalid="ignore"):  # signalling-NaN patterns warn when widened
            g = _all_patterns(fmt.numpy_dtype, fmt.bits).astype(np.float64)
    else:  # tf32 values are fp32 patterns with the low 13 mantissa bits clear
        fields = np.array([0, 1, 2, 126, 127, 128, 253, 254], dtype=np.uint32)
        low = 23 - fmt.mantissa_bits
        g = ((fields[:, None] << 23) | (np.arange(2**fmt.mantissa_bits, dtype=np.uint32) << low)).ravel()
        g = g.view(np.float32).astype(np.float64)
    g = np.unique(g[np.isfinite(g) & (g >= 0)])
    return np.append(g, fmt.max + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits))


def _f32_with_negatives(v64: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        v = v64.astype(np.float32)
    return np.concatenate([v, -v])


def _with_neighbours(v: np.ndarray) -> np.ndarray:
    """v and its fp32 neighbours either side."""
    return np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))])


def _edges(fmt: Format) -> np.ndarray:
    """Values at and around (±1 fp32 ulp) every boundary of fmt, and every midpoint of its grid."""
    g = _grid(fmt)
    mids = (g[:-1] + g[1:]) / 2  # exact ties between neighbours: must round to even
    sub = fmt.min_subnormal
    points = [
        0.0, sub, sub / 2, 1.5 * sub, fmt.min_normal, fmt.min_normal - sub / 2,
        fmt.max, fmt.max + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits - 1),  # halfway above max
        1.0, 1 + fmt.eps / 2, 1 + 1.5 * fmt.eps, np.inf, np.nan,
    ]
    return np.concatenate([_with_neighbours(_f32_with_negatives(np.array(points))), _f32_with_negatives(mids)])


@functools.cache
def input_set(name: str) -> np.ndarray:
    if name.startswith("all_"):
        fmt = get_format(name[4:])
        return _all_patterns(fmt.numpy_dtype, fmt.bits)
    if name == "edges":
        return np.concatenate([_edges(f) for f in ALL_FORMATS if f is not FP32] + [_edges(TF32)])
    assert name == "random"
    rng = np.random.default_rng(20240601)
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan] * 4)  # random bits rarely hit these
    parts = [specials, rng.integers(-(2**31), 2**31, size=50_000, dtype=np.int64).astype(np.int32).view(np.float32)]
    for fmt in (TF32, FP16, BF16, FP8_E4M3, FP8_E5M2):  # exponents spanning each format's range
        lo = max(0, 127 + fmt.min_exponent - fmt.mantissa_bits - 3)
        hi = min(254, 127 + fmt.max_exponent + 2)
        field = rng.integers(lo, hi + 1, size=20_000, dtype=np.uint32)
        mant = rng.integers(0, 2**23, size=20_000, dtype=np.uint32)
        sign = rng.integers(0, 2, size=20_000, dtype=np.uint32) << 31
        parts.append((sign | (field << 23) | mant).view(np.float32))
    return np.concatenate(parts)


INPUT_SETS = ["all_fp16", "all_bf16", "all_e4m3", "all_e5m2", "random", "edges"]


# ----------------------------------------------------------------------------- quantize vs references

@pytest.mark.parametrize("saturate", [False, True], ids=["inf", "saturate"])
@pytest.mark.parametrize("fmt", ML_FORMATS, ids=ids)
@pytest.mark.parametrize("inputs", INPUT_SETS)
def test_quantize_matches_ml_dtypes(inputs, fmt, saturate):
    x = input_set(inputs)
    assert_same_bits(quantize(torch.from_numpy(x), fmt, saturate=saturate), ml_reference(x, fmt, saturate), x)


@pytest.mark.parametrize("saturate", [False, True], ids=["inf", "saturate"])
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=ids)
@pytest.mark.parametrize("inputs", INPUT_SETS)
def test_quantize_matches_float64_arithmetic(inputs, fmt, saturate):
    x = input_set(inputs)
    assert_same_bits(quantize(torch.from_numpy(x), fmt, saturate=saturate), f64_reference(x, fmt, saturate), x)


def test_input_sets_are_big_enough():
    assert input_set("random").size >= 100_000
    assert input_set("all_fp16").size == input_set("all_bf16").size == 65_536
    assert input_set("all_e4m3").size == input_set("all_e5m2").size == 256


# ----------------------------------------------------------------------------- hand-worked cases

def _q(values, fmt, saturate=False) -> list[float]:
    return quantize(torch.tensor(values, dtype=torch.float64), fmt, saturate=saturate).tolist()


@pytest.mark.parametrize(
    "fmt, x, want",
    [
        (FP16, 65504.0, 65504.0),
        (FP16, 65519.99, 65504.0),            # below the tie above max
        (FP16, 65520.0, float("inf")),        # tie: 65504 has an odd mantissa, so up -> inf
        (FP16, -65520.0, float("-inf")),
        (FP16, 1 + 2**-11, 1.0),              # tie between 1 and 1 + 2**-10 -> even (1)
        (FP16, 1 + 3 * 2**-11, 1 + 2**-9),    # tie between odd 1+2**-10 and even 1+2**-9
        (FP16, 2**-25, 0.0),                  # min_subnormal / 2: tie -> 0
        (FP16, 3 * 2**-25, 2**-23),           # 1.5 * min_subnormal: tie -> 2 * min_subnormal
        (BF16, 1 + 2**-8, 1.0),
        (BF16, 1 + 3 * 2**-8, 1 + 2**-6),
        (BF16, 2**-134, 0.0),                 # bf16 subnormals are fp32 subnormals
        (BF16, 3 * 2**-134, 2**-132),
        (FP8_E4M3, 464.0, 448.0),             # tie above max: 448 = 1.110b * 2**8 is even
        (FP8_E4M3, 480.0, float("nan")),      # no inf in e4m3fn: overflow is NaN
        (FP8_E4M3, 2**-10, 0.0),
        (FP8_E4M3, 3 * 2**-10, 2**-8),
        (FP8_E5M2, 61440.0, float("inf")),    # tie above 57344 = 1.11b * 2**15 (odd) -> up
        (FP8_E5M2, 61439.0, 57344.0),
        (TF32, 1 + 2**-11, 1.0),              # tf32 has fp16's 10 mantissa bits
        (TF32, 1 + 3 * 2**-11, 1 + 2**-9),
        (TF32, 1 + 2**-11 + 2**-23, 1 + 2**-10),  # one fp32 ulp above the tie
        (TF32, 1 + 2**-11 - 2**-23, 1.0),     # one fp32 ulp below the tie
        (TF32, 2 - 2**-11, 2.0),              # tie, carry into the exponent
        (TF32, 65520.0, 65536.0),             # the same tie as in fp16, but fp32's range: no overflow
        (TF32, (2 - 2**-11) * 2.0**127, float("inf")),  # tie above tf32 max
        (TF32, 2**-137, 0.0),                 # tf32 min_subnormal = 2**-136
        (TF32, 3 * 2**-137, 2**-135),
        (FP32, 1 + 2**-23, 1 + 2**-23),       # identity
    ],
)
def test_quantize_hand_worked(fmt, x, want):
    (got,) = _q([x], fmt)
    assert got == want or (np.isnan(want) and np.isnan(got)), (fmt.name, x, got, want)


@pytest.mark.parametrize(
    "fmt, x, want",
    [
        (FP16, 65520.0, 65504.0), (FP16, -1e9, -65504.0), (FP16, float("inf"), float("inf")),
        (FP16, float("-inf"), float("-inf")), (FP16, 1.0, 1.0),
        (FP8_E4M3, 465.0, 448.0), (FP8_E4M3, -1e30, -448.0),
        (FP8_E4M3, float("inf"), float("nan")),  # saturate clamps finite values only
        (FP8_E5M2, 1e6, 57344.0), (BF16, 3.4e38, 3.3895313892515355e38),
        (TF32, 3.4028234e38, (2 - 2**-10) * 2.0**127),
    ],
)
def test_quantize_saturate_hand_worked(fmt, x, want):
    (got,) = _q([x], fmt, saturate=True)
    assert got == want or (np.isnan(want) and np.isnan(got)), (fmt.name, x, got, want)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=ids)
def test_signed_zero_and_nan_survive(fmt):
    out = quantize(torch.tensor([-0.0, 0.0, -1e-45, float("nan")]), fmt)
    # -1e-45 is fp32's smallest subnormal (bits 0x80000001); every other format flushes it to -0.
    assert out.view(torch.int32)[:3].tolist() == [-(2**31), 0, -(2**31) + (fmt is FP32)]
    assert torch.isnan(out[3])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=64))
def test_tf32_clears_low_13_bits_within_half_ulp(values):
    x = torch.tensor(values, dtype=torch.float32)
    q = quantize(x, TF32)
    x64, q64 = x.double(), q.double()
    e = torch.frexp(x64).exponent.clamp(min=-125) - 1  # floor(log2|x|), fp32 subnormals share -126
    half_ulp = torch.ldexp(torch.full_like(x64, 0.5), e - 10)
    finite = torch.isfinite(q)
    assert (q.view(torch.int32)[finite] & 0x1FFF).eq(0).all()
    assert ((q64 - x64).abs()[finite] <= half_ulp[finite]).all()
    assert (x64.abs()[~finite] >= (2 - 2**-11) * 2.0**127).all()  # inf only past the tie above max


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(ALL_FORMATS),
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=2, max_size=64),
)
def test_quantize_is_monotone_and_idempotent(fmt, values):
    x = torch.tensor(sorted(values), dtype=torch.float32)
    # saturate keeps e4m3 overflow finite and ordered (inf input is excluded: e4m3 makes it NaN)
    q = quantize(x, fmt, saturate=True)
    assert (q[1:] >= q[:-1]).all()
    assert torch.equal(quantize(q, fmt, saturate=True).view(torch.int32), q.view(torch.int32))


# ----------------------------------------------------------------------------- quantize API

def test_quantize_converts_other_float_dtypes_to_float32():
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        out = quantize(torch.tensor([1 + 2**-8, 3.0], dtype=dtype), FP8_E4M3)
        assert out.dtype == torch.float32 and out.tolist() == [1.0, 3.0]


def test_quantize_keeps_shape_and_strides_do_not_matter():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).t()  # non-contiguous
    out = quantize(x, FP16)
    assert out.shape == (48, 64)
    assert torch.equal(out, quantize(x.contiguous(), FP16))


def test_quantize_does_not_alias_or_mutate_input():
    x = torch.tensor([1.1, 2.2])
    before = x.clone()
    for fmt in (FP32, FP16):
        out = quantize(x, fmt)
        out.add_(1)
        assert torch.equal(x, before)


def test_quantize_rejects_integer_tensors():
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.tensor([1, 2]), FP16)


def test_quantize_runs_on_meta_device():
    # Meta tensors carry no data: this passes only if quantize never reads values on the host.
    out = quantize(torch.empty(3, 5, device="meta"), FP8_E4M3)
    assert out.device.type == "meta" and out.shape == (3, 5) and out.dtype == torch.float32


# ----------------------------------------------------------------------------- Format constants

@pytest.mark.parametrize("fmt", [FP32, *ML_FORMATS], ids=ids)
def test_constants_match_ml_dtypes_finfo(fmt):
    fi = ml_dtypes.finfo(fmt.numpy_dtype)
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert (fmt.bits, fmt.mantissa_bits, fmt.exponent_bits) == (fi.bits, fi.nmant, fi.nexp)
    with np.errstate(over="ignore", invalid="ignore"):
        assert fmt.has_inf == bool(np.isinf(np.float32(np.inf).astype(fmt.numpy_dtype)))


@pytest.mark.parametrize("fmt", [FP32, *ML_FORMATS], ids=ids)
def test_constants_match_torch_finfo(fmt):
    fi = torch.finfo(fmt.torch_dtype)
    assert (fmt.max, fmt.min_normal, fmt.eps, fmt.bits) == (fi.max, fi.smallest_normal, fi.eps, fi.bits)


def test_tf32_constants_by_hand():
    assert TF32.max == (2 - 2**-10) * 2.0**127
    assert (TF32.min_normal, TF32.min_subnormal, TF32.eps) == (2.0**-126, 2.0**-136, 2.0**-10)
    assert (TF32.bits, TF32.torch_dtype, TF32.numpy_dtype, TF32.has_inf) == (32, None, None, True)


def test_fp8_e4m3_is_the_fn_variant():
    assert (FP8_E4M3.max, FP8_E4M3.has_inf, FP8_E4M3.torch_dtype) == (448.0, False, torch.float8_e4m3fn)
    assert FP8_E5M2.torch_dtype == torch.float8_e5m2


def test_format_is_frozen_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FP16.max = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="exponent_bits"):
        dataclasses.replace(FP16, exponent_bits=9)
    with pytest.raises(ValueError, match="mantissa_bits"):
        dataclasses.replace(FP16, mantissa_bits=0)
    with pytest.raises(ValueError, match="bits=8"):
        dataclasses.replace(FP16, bits=8)


# ----------------------------------------------------------------------------- get_format

@pytest.mark.parametrize(
    "spec, fmt",
    [
        ("fp32", FP32), ("float32", FP32), ("tf32", TF32), ("fp16", FP16), ("float16", FP16),
        ("half", FP16), ("bf16", BF16), ("bfloat16", BF16), ("BF16", BF16),
        ("fp8_e4m3", FP8_E4M3), ("e4m3", FP8_E4M3), ("fp8-e4m3", FP8_E4M3), ("float8_e4m3fn", FP8_E4M3),
        ("fp8_e5m2", FP8_E5M2), ("e5m2", FP8_E5M2),
        (torch.float32, FP32), (torch.float16, FP16), (torch.bfloat16, BF16),
        (torch.float8_e4m3fn, FP8_E4M3), (torch.float8_e5m2, FP8_E5M2), (FP16, FP16),
    ],
)
def test_get_format_aliases(spec, fmt):
    assert get_format(spec) is fmt


@pytest.mark.parametrize("spec", ["fp12", "e4m3fnuz", "", torch.float64, torch.float8_e4m3fnuz])
def test_get_format_unknown_lists_valid_names(spec):
    with pytest.raises(ValueError) as info:
        get_format(spec)
    valid = list(FORMATS) if isinstance(spec, str) else ["torch.float16", "torch.bfloat16"]
    assert all(name in str(info.value) for name in valid), str(info.value)


def test_get_format_wrong_type():
    with pytest.raises(TypeError):
        get_format(16)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- classify

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "fmt, values, want",
    [
        # zero: 0, -0 | flush: 1e-8, 2.9e-8 (< min_sub/2 = 2.98e-8) | subnormal: 3e-8, 1e-6,
        # 6.1e-5 (-> largest subnormal) | normal: 1, -3, 65519.99 | overflow: 65520, 7e4, -1e10
        (FP16, [0.0, -0.0, 1e-8, 2.9e-8, 3e-8, 1e-6, 6.1e-5, 1.0, -3.0, 65519.99, 65520.0, 7e4, -1e10, INF, -INF, NAN],
         RangeCounts(zero=2, flush=2, subnormal=3, normal=3, overflow=3, nonfinite=3)),
        # 464 -> 448 normal, 465 -> NaN overflow, 2**-10 ties to 0, 0.0146 -> largest subnormal
        (FP8_E4M3, [464.0, 465.0, 2**-10, 2**-10 * 1.001, 0.0146, 2**-6, INF],
         RangeCounts(zero=0, flush=1, subnormal=2, normal=2, overflow=1, nonfinite=1)),
        (BF16, [1e-40, 1e-45, 3e38, 3.4e38, 1.0], RangeCounts(0, 1, 1, 2, 1, 0)),
        (FP32, [1e300, 1e-300, 1.0, 0.0, INF], RangeCounts(1, 1, 0, 1, 1, 1)),  # float64 input
    ],
    ids=["fp16", "e4m3", "bf16", "fp32_from_f64"],
)
def test_classify_hand_worked(fmt, values, want):
    counts = classify(torch.tensor(values, dtype=torch.float64 if fmt is FP32 else torch.float32), fmt)
    assert counts == want
    assert counts.total == len(values)
    assert all(type(v) is int for v in dataclasses.astuple(counts))


def test_classify_empty_and_fractions():
    empty = classify(torch.empty(0), FP16)
    assert empty.total == 0 and set(empty.fractions().values()) == {0.0}
    frac = classify(torch.tensor([0.0, 1.0, 1.0, 1e9]), FP16).fractions()
    assert frac == {"zero": 0.25, "flush": 0.0, "subnormal": 0.0, "normal": 0.5, "overflow": 0.25, "nonfinite": 0.0}


@pytest.mark.parametrize("fmt", ML_FORMATS, ids=ids)
def test_classify_matches_numpy_brute_force(fmt):
    x = input_set("random")
    q = ml_reference(x, fmt)
    zero, nonfinite = x == 0, ~np.isfinite(x)
    live = ~(zero | nonfinite)
    overflow = live & ~np.isfinite(q)
    flush = live & (q == 0)
    subnormal = live & (q != 0) & (np.abs(q) < ml_dtypes.finfo(fmt.numpy_dtype).smallest_normal)
    normal = live & ~(overflow | flush | subnormal)
    want = RangeCounts(*(int(b.sum()) for b in (zero, flush, subnormal, normal, overflow, nonfinite)))
    got = classify(torch.from_numpy(x), fmt)
    assert got == want and got.total == x.size
    assert min(dataclasses.astuple(got)) > 0  # the random set reaches every bucket

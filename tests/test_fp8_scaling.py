"""fp8 scales worked out by hand, the saturating cast against formats.quantize, and scaled_mm against
its emulation."""

import math

import pytest
import torch

from mixprec import FP8_E4M3, FP8_E5M2
from mixprec.formats import quantize
from mixprec.fp8 import (amax_f32, cast_to_fp8, current_scale, delayed_scale, emulated_mm, probe_scaled_mm,
                         quantize_fp8, record_amax, scaled_mm)

T = torch.tensor
INF, NAN = math.inf, math.nan


@pytest.mark.parametrize("amax, margin, pow2, expected", [
    (3.5, 0, False, 128.0),          # 448 / 3.5
    (3.5, 2, False, 32.0),           # 448 / 3.5 / 2**2
    (3.0, 0, True, 128.0),           # 448 / 3 = 149.3 -> largest power of two below: 2**7
    (0.5, 0, True, 512.0),           # 448 / 0.5 = 896 -> 512
    (448.0, 0, True, 1.0),           # exactly a power of two stays
    (0.0, 0, False, 1.0),            # a zero tensor: fall back to 1
    (INF, 0, False, 1.0),            # inf or NaN: fall back to 1, never 0 or NaN
    (NAN, 0, False, 1.0),
    (1e-30, 0, False, 2.0**64),      # a tiny amax: capped so the scale and x * scale stay finite
])
def test_current_scale_by_hand(amax, margin, pow2, expected):
    assert current_scale(T(amax), FP8_E4M3, margin=margin, pow2=pow2).item() == expected


def test_e5m2_uses_its_own_max():
    assert current_scale(T(7.0), FP8_E5M2).item() == 57344.0 / 7.0 == 8192.0


def _correctly_rounded_scales(amax, fmt, margin, pow2):
    """fl32(fmax / amax) from a float64 quotient (exact to 2**-53, so its fp32 rounding is the correctly
    rounded one: fp32's halfway points need 25 bits, a quotient of two 24-bit numbers is never one),
    capped at 2**64, divided by 2**margin, then floored to 2**k when pow2."""
    q = (fmt.max / amax.double()).clamp(max=2.0**64).float() * 2.0**-margin
    if pow2:
        q = torch.exp2(torch.floor(torch.log2(q.double()))).float()      # exact on fp32 inputs
    return q


@pytest.mark.parametrize("fmt", [FP8_E4M3, FP8_E5M2], ids=["e4m3", "e5m2"])
def test_scale_is_the_correctly_rounded_quotient_for_many_amaxes(fmt):
    # fmax / amax as Tensor.__rtruediv__ (reciprocal, then * fmax: two roundings) is one ulp off the
    # correctly rounded quotient for about a quarter of amaxes; the scale must be the one rounding.
    g = torch.Generator().manual_seed(33)
    amax = torch.exp(torch.randn(4000, generator=g, dtype=torch.float64) * 12).float()   # ~1e-23 .. 1e23
    amax = amax[(amax > 0) & torch.isfinite(amax)]
    assert (amax < fmt.max * 2.0**-64).any()              # some hit the 2**64 cap
    for margin, pow2 in ((0, False), (1, False), (0, True)):
        want = _correctly_rounded_scales(amax, fmt, margin, pow2)
        got = current_scale(amax, fmt, margin=margin, pow2=pow2)
        assert torch.equal(got, want), (margin, pow2, int((got != want).sum()))
        # delayed scaling: the same quotient from a history whose max is that amax
        got_d = torch.stack([delayed_scale(torch.stack([a / 4, a, torch.zeros(())]), torch.zeros(()),
                                           torch.ones(()), fmt, algo="max", margin=margin, pow2=pow2)
                             for a in amax[:300]])
        assert torch.equal(got_d, want[:300]), (margin, pow2, int((got_d != want[:300]).sum()))


def _walk(amaxes, **kwargs):
    history, scale, scales = torch.zeros(3), T(1.0), []
    for a in amaxes:
        scale = delayed_scale(history, T(a), scale, FP8_E4M3, **kwargs)
        record_amax(history, T(a))
        scales.append(scale.item())
    return scales, history.tolist()


AMAXES = [2.0, 8.0, 0.0, INF, 1.0, NAN, 4.0, 3.5]


def test_delayed_scale_over_several_steps_by_hand():
    # history length 3, amax = max of history; the first step has an empty history and uses its own amax.
    # step: amax seen -> history max used -> scale = 448 / that; then the amax enters the history
    # (inf and NaN enter as 0).  0: 2 -> (empty: own 2) 224 | 1: 8 -> 2 -> 224 | 2: 0 -> 8 -> 56
    # 3: inf -> 8 -> 56 | 4: 1 -> 8 -> 56 | 5: NaN -> max(1, 0, 0) = 1 -> 448 | 6: 4 -> 1 -> 448
    # 7: 3.5 -> max(4, 0, 1) = 4 -> 112
    scales, history = _walk(AMAXES, algo="max")
    assert scales == [224.0, 224.0, 56.0, 56.0, 56.0, 448.0, 448.0, 112.0]
    assert history == [3.5, 4.0, 0.0]


def test_delayed_scale_most_recent_by_hand():
    # algo=recent uses history[0]; where it is 0 the cast's own amax stands in, where that is unusable
    # too (step 3: inf) the previous scale is kept.
    # 0: own 2 -> 224 | 1: recent 2 -> 224 | 2: recent 8 -> 56 | 3: recent 0, own inf -> keep 56
    # 4: recent 0 (inf recorded as 0), own 1 -> 448 | 5: recent 1 -> 448 | 6: recent 0, own 4 -> 112
    # 7: recent 4 -> 112
    scales, _ = _walk(AMAXES, algo="recent")
    assert scales == [224.0, 224.0, 56.0, 56.0, 448.0, 448.0, 112.0, 112.0]


def test_delayed_scale_with_margin_and_pow2_by_hand():
    # 448 / A / 2 rounded down to 2**k: A=2 -> 112 -> 64; A=8 -> 28 -> 16; A=1 -> 224 -> 128; A=4 -> 56 -> 32
    scales, _ = _walk(AMAXES, algo="max", margin=1, pow2=True)
    assert scales == [64.0, 64.0, 16.0, 16.0, 16.0, 128.0, 128.0, 32.0]


def test_only_zero_tensors_keep_the_initial_scale():
    scales, history = _walk([0.0, 0.0, INF, NAN], algo="max")
    assert scales == [1.0, 1.0, 1.0, 1.0] and history == [0.0, 0.0, 0.0]


def test_amax_is_exact_and_sees_nan():
    x = torch.tensor([[-3.0, 2.5], [0.0, 1.0]], dtype=torch.bfloat16)
    assert amax_f32(x).item() == 3.0 and amax_f32(x).dtype == torch.float32
    assert math.isnan(amax_f32(T([1.0, NAN])).item())


SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-9, -3e-3, 0.0625, 464.0, 500.0, -1e6, 6e4, INF, -INF, NAN, 2.0**-9, 2.0**-10]


@pytest.mark.parametrize("fmt", [FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_is_bitwise_quantize_with_saturation(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([T(SPECIAL), torch.randn(4000, generator=g) * 10.0 ** torch.randint(-6, 6, (4000,), generator=g)])
    x = x.to(dtype)
    for scale in (1.0, 3.0, 2.0**-5, 448.0 / 7):
        s = T(scale)
        got = cast_to_fp8(x, s, fmt).float()
        want = quantize(x.float() * s, fmt, saturate=True)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))   # signed zeros too
        emulated = quantize_fp8(x, s, fmt)          # the emulation's operands: the same values as fp32
        assert torch.equal(torch.isnan(emulated), nan)
        assert torch.equal(emulated[~nan].view(torch.int32), want[~nan].view(torch.int32))
    # The cases the torch cast alone gets differently: finite overflow saturates, inf stays visible.
    out = cast_to_fp8(T([1e6, INF, -INF]), T(1.0), fmt).float()
    assert out[0].item() == fmt.max
    if fmt.has_inf:
        assert out[1:].tolist() == [INF, -INF]
    else:
        assert torch.isnan(out[1:]).all()      # torch's own e4m3 cast would give 448


needs_scaled_mm = pytest.mark.skipif(not probe_scaled_mm("cpu").ok, reason="torch._scaled_mm does not run "
                                     f"on this CPU build: {probe_scaled_mm('cpu').reason}")


@needs_scaled_mm
@pytest.mark.parametrize("fmt_a", [FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_mm_agrees_with_the_emulation(fmt_a, out_dtype):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(48, 96, generator=g) * 3, torch.randn(96, 32, generator=g) / 5
    s_a, s_b = current_scale(a.abs().max(), fmt_a), current_scale(b.abs().max(), FP8_E4M3)
    inv_a, inv_b = s_a.reciprocal(), s_b.reciprocal()
    real = scaled_mm(cast_to_fp8(a, s_a, fmt_a), cast_to_fp8(b, s_b, FP8_E4M3), inv_a, inv_b, out_dtype)
    emul = emulated_mm(quantize_fp8(a, s_a, fmt_a), quantize_fp8(b, s_b, FP8_E4M3), inv_a, inv_b, out_dtype)
    assert real.dtype == emul.dtype == out_dtype
    # The exact product of the fp8 operands (float64), against which both may differ only by the
    # output dtype's rounding (one ulp) plus fp32 summation-order noise.
    exact = (quantize_fp8(a, s_a, fmt_a).double() @ quantize_fp8(b, s_b, FP8_E4M3).double()
             ) * inv_a.double() * inv_b.double()
    ulp = torch.finfo(out_dtype).eps * exact.abs() + 1e-5 * exact.abs().max()
    assert ((real.double() - exact).abs() <= ulp).all()
    assert ((emul.double() - exact).abs() <= ulp).all()
    assert ((real.double() - emul.double()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("k", [40, 32, 17])
def test_cuda_operand_layout_and_padding_keep_the_product(k):
    # The CUDA path's operand preparation, checked on the CPU (it is device-agnostic): row-major a,
    # column-major b, K zero-padded to a multiple of 16, and the exact same product.
    from mixprec.fp8.matmul import _operands
    g = torch.Generator().manual_seed(k)
    a = torch.randn(7, k, generator=g).to(torch.float8_e5m2)
    b = torch.randn(32, k, generator=g).to(torch.float8_e4m3fn).t()          # (K, N), a transposed view
    a_p, b_p = _operands(a, b, pad=True)
    k_pad = -(-k // 16) * 16
    a_l, b_l = _operands(a, b, pad=False)            # other devices: the layouts only, no padding
    assert b_l.shape == (k, 32) and b_l.stride() == (1, k) and b_l.data_ptr() == b.data_ptr()
    assert a_p.shape == (7, k_pad) and a_p.stride() == (k_pad, 1)
    assert b_p.shape == (k_pad, 32) and b_p.stride() == (1, k_pad)
    assert torch.equal(a_p.float() @ b_p.float(), a.float() @ b.float())

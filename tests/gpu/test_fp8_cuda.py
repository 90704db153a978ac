"""CUDA-only fp8 checks: torch._scaled_mm's CUDA path (layouts, inner-dim padding) against the emulation,
the fp8 linear against bf16, and an fp8 training step without a host sync."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import FP8_E4M3, FP8_E5M2, Fp8Config
from mixprec.fp8 import (Fp8Linear, cast_to_fp8, current_scale, emulated_mm, probe_scaled_mm, quantize_fp8,
                         scaled_mm)

from conftest import fp8_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def sqnr_db(ref, x):
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


# How far torch._scaled_mm may be from the exact product of its fp8 operands, and why.
# Each product of two fp8 values is exact (4-bit x 4-bit significands); only the sum rounds. Hopper's fp8
# tensor cores do not sum in fp32: partial sums live in an accumulator that keeps about 14 significant
# bits (DeepSeek-V3 report, 3.3.2, measured on H800), so every addition may lose up to 2**-13 of the
# running sum, i.e. of up to max|exact|. Without fast accumulation cuBLAS moves the partial sums into fp32
# at intervals along K, so the errors of the narrow sums add up like a random walk: sqrt(K) of them.
#     |scaled_mm - exact| <= sqrt(K) * 2**-13 * max|exact|  (+ one rounding to out_dtype)
# Measured on one H100, torch 2.11, 2026-11-22 (gpu-findings profiles.txt, e4m3 x e4m3, out fp32), as a
# fraction of this bound: K=128 0.31, K=1024 0.046, K=8192 0.014 (and 0.29 at K=8192 with fast
# accumulation, which mixprec never asks for: tests/test_fp8_linear.py). An fp32-exact bound
# (eps_fp32 |exact|) failed 9 of 12 cases here: the accumulator is the reason, not a bug.
_ACC_UNIT = 2.0**-13


def accumulator_bound(exact, k, out_dtype):
    return math.sqrt(k) * _ACC_UNIT * exact.abs().max() + torch.finfo(out_dtype).eps * exact.abs()


# (M, K, N): K = 40 and K = 24 exercise the zero padding of the inner dimension (the weight-gradient
# matmul's inner dimension is the batch, rarely a multiple of 16).
@pytest.mark.parametrize("m, k, n", [(64, 128, 96), (7, 40, 32), (128, 24, 16)])
@pytest.mark.parametrize("fmt_a", [FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_scaled_mm_agrees_with_the_emulation(m, k, n, fmt_a, out_dtype):
    fp8_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g) * 3
    b = torch.randn(n, k, device="cuda", generator=g).t()    # (K, N), as the forward hands it
    s_a, s_b = current_scale(a.abs().max(), fmt_a), current_scale(b.abs().max(), FP8_E4M3)
    inv_a, inv_b = s_a.reciprocal(), s_b.reciprocal()
    real = scaled_mm(cast_to_fp8(a, s_a, fmt_a), cast_to_fp8(b, s_b, FP8_E4M3), inv_a, inv_b, out_dtype)
    emul = emulated_mm(quantize_fp8(a, s_a, fmt_a), quantize_fp8(b, s_b, FP8_E4M3), inv_a, inv_b, out_dtype)
    exact = (quantize_fp8(a, s_a, fmt_a).double() @ quantize_fp8(b, s_b, FP8_E4M3).double()
             ) * inv_a.double() * inv_b.double()
    # The emulation sums in fp32: within the output rounding and fp32 sums of K terms.
    fp32_sum = torch.finfo(out_dtype).eps * exact.abs() + k * 2.0**-24 * exact.abs().max()
    assert ((emul.double() - exact).abs() <= fp32_sum).all()
    # The hardware: within the accumulator bound above. A wrong scale, layout or padding is off by
    # O(|exact|), hundreds of times more.
    err = (real.double() - exact).abs()
    assert (err <= accumulator_bound(exact, k, out_dtype)).all(), (err.max(), exact.abs().max())


def test_cuda_scaled_mm_long_sums_are_promoted_to_fp32():
    # K = 8192, the weight gradient of a batch of 8192 tokens. Measured on the H100 (profiles.txt):
    # max error 14x sqrt(K) 2**-23 max|exact| as mixprec calls it, 294x with fast accumulation; the
    # line at 64x separates the two with a factor of 4 on either side.
    fp8_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    k = 8192
    a = torch.randn(256, k, device="cuda", generator=g)
    b = torch.randn(256, k, device="cuda", generator=g).t()
    s_a, s_b = current_scale(a.abs().max(), FP8_E4M3), current_scale(b.abs().max(), FP8_E4M3)
    inv_a, inv_b = s_a.reciprocal(), s_b.reciprocal()
    real = scaled_mm(cast_to_fp8(a, s_a, FP8_E4M3), cast_to_fp8(b, s_b, FP8_E4M3), inv_a, inv_b, torch.float32)
    exact = (quantize_fp8(a, s_a, FP8_E4M3).double() @ quantize_fp8(b, s_b, FP8_E4M3).double()
             ) * inv_a.double() * inv_b.double()
    ratio = ((real.double() - exact).abs().max() / (math.sqrt(k) * 2.0**-23 * exact.abs().max())).item()
    assert ratio <= 64, ratio


@pytest.mark.parametrize("config", ["current", "delayed"])
def test_cuda_fp8_linear_against_bf16(config):
    fp8_gpu()
    torch.manual_seed(0)
    linear = nn.Linear(1024, 512).cuda()
    x = torch.randn(4, 100, 1024, device="cuda")              # M = 400: padded in the weight gradient
    g = torch.randn(4, 100, 512, device="cuda") * 1e-3
    results = []
    for layer in (linear, Fp8Linear.from_linear(linear, Fp8Config.parse(config), "scaled_mm")):
        for _ in range(2):
            xi = x.clone().requires_grad_(True)
            linear.weight.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(xi)
            out.backward(g.to(out.dtype))
        results.append((out.float(), xi.grad.float(), linear.weight.grad.float()))
    (ref, got) = results
    assert sqnr_db(ref[0], got[0]) >= 20
    assert sqnr_db(ref[1], got[1]) >= 18 and sqnr_db(ref[2], got[2]) >= 18


@pytest.mark.parametrize("recipe", ["fp8", "fp8-delayed"])
def test_cuda_fp8_step_runs_without_host_sync(recipe, no_sync):
    fp8_gpu()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.GELU(), nn.Linear(512, 256),
                          nn.GELU(), nn.Linear(256, 16)).cuda()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe)
    assert mp.fp8_report.backend == "scaled_mm" and mp.fp8_report.swapped == ("0", "3", "5")
    x, y = torch.randn(64, 256, device="cuda"), torch.randint(0, 16, (64,), device="cuda")
    for _ in range(2):
        with mp.autocast():
            mp.backward(F.cross_entropy(model(x), y))
        mp.step()
        mp.zero_grad()
    with no_sync():
        for _ in range(3):
            with mp.autocast():
                loss = F.cross_entropy(model(x), y)
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
    assert torch.isfinite(loss)


def test_gpu_without_fp8_emulates_with_a_notice():
    if probe_scaled_mm("cuda").ok:
        pytest.skip("this GPU runs fp8 matmuls; the notice is for older ones")
    model = nn.Sequential(nn.Linear(64, 64)).cuda()
    with pytest.warns(mixprec.Fp8EmulationWarning, match="emulated on cuda"):
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    assert mp.fp8_report.backend == "emulate"


# Routing gives any number of rows per expert: aligned group ends, and ends at odd rows.
@pytest.mark.parametrize("offs", [[64, 64, 160, 256], [37, 37, 150, 256]], ids=["aligned", "ragged"])
def test_grouped_expert_gemm_on_hopper_agrees_with_the_emulation(offs):
    # The forward GEMM of a mixture of experts on torch._scaled_grouped_mm (Hopper), against the same
    # layer emulated: identical fp8 operands and scales, so only the accumulation differs (the bound
    # above, with K = 256 per row) and one bf16 rounding each. The gradients are emulated on both.
    from mixprec.devices import probe_fp8_kernel
    from mixprec.fp8 import Fp8GroupedLinear
    fp8_gpu()
    support = probe_fp8_kernel("grouped", "cuda")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch._scaled_grouped_mm runs on Hopper (compute capability 9.x) only")
    assert support.ok, support.reason
    torch.manual_seed(0)
    e, n, k = 4, 128, 256                                     # expert 1 gets no rows
    x = torch.randn(offs[-1], k, device="cuda")
    w = torch.randn(e, n, k, device="cuda") / 16
    outs = []
    for backend in ("scaled_mm", "emulate"):
        layer = Fp8GroupedLinear(e, n, k, Fp8Config(), backend=backend, device="cuda")
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi, wi, torch.tensor(offs, dtype=torch.int32, device="cuda"))
        y.float().square().sum().backward()
        outs.append((y.float(), xi.grad, wi.grad))
    (y_k, gx_k, gw_k), (y_e, gx_e, gw_e) = outs
    bound = math.sqrt(k) * _ACC_UNIT * y_e.abs().max().item() + 2 * 2.0**-8 * y_e.abs().max().item()
    assert (y_k - y_e).abs().max().item() <= bound
    # The gradients start from y, which differs by that much: compare them loosely, as SQNR.
    assert sqnr_db(gx_e, gx_k) > 30 and sqnr_db(gw_e, gw_k) > 30
    assert torch.equal(gw_k[1], torch.zeros_like(gw_k[1]))

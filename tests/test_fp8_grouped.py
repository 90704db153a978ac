"""fp8 grouped GEMMs (a mixture of experts' projections): each of the three GEMMs equals a float64
computation from independently quantized operands, group by group; empty groups get zero gradient;
the scale state behaves as Fp8Linear's (recorded once per real forward, delayed histories, round
trip); torch.compile(fullgraph) runs the same numbers."""

import pytest
import torch

from mixprec import Fp8Config
from mixprec.formats import FP8_E4M3, FP8_E5M2, quantize
from mixprec.fp8.grouped import Fp8GroupedLinear, grouped_mm_f32
from mixprec.fp8.scaling import current_scale

E, N, K = 4, 32, 48
OFFS = [5, 5, 12, 20]             # expert 1 gets no rows; rows 12..20 go to expert 3


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(OFFS[-1], K, generator=g) * 3
    w = torch.randn(E, N, K, generator=g) / 7
    w[2] *= 50                    # one expert far larger: all experts share the 3-D weight's one scale
    grad = torch.randn(OFFS[-1], N, generator=g) * 1e-3
    return x, w, grad


def _deq(t: torch.Tensor, fmt) -> torch.Tensor:
    """t quantized with its own current per-tensor scale, dequantized, in float64 (formats.quantize: the
    integer-arithmetic rounding, independent of the torch float8 cast the layer uses)."""
    scale = current_scale(t.abs().max().float(), fmt)
    return quantize(t.float() * scale, fmt, saturate=True).double() / scale.double()


def _reference(x, w, grad):
    """Per expert, in float64, from the dequantized operands: y, grad_x, grad_W."""
    xq, wq, gq = _deq(x, FP8_E4M3), _deq(w, FP8_E4M3), _deq(grad, FP8_E5M2)
    y, gx, gw = torch.zeros(len(x), N, dtype=torch.float64), torch.zeros_like(xq), torch.zeros_like(wq)
    start = 0
    for e, end in enumerate(OFFS):
        y[start:end] = xq[start:end] @ wq[e].T
        gx[start:end] = gq[start:end] @ wq[e]
        gw[e] = gq[start:end].T @ xq[start:end]
        start = end
    return y, gx, gw


def _run(layer, x, w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = layer(x, w, torch.tensor(OFFS, dtype=torch.int32))
    y.backward(grad)
    return y.detach(), x.grad, w.grad


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums of exact fp8 products, against float64 sums: a few fp32 ulps of the largest term.
    tol = 4 * 2.0**-23 * K * want.abs().max().item() + 1e-30
    assert (got.double() - want).abs().max().item() <= tol


def test_each_grouped_gemm_equals_float64_from_the_dequantized_operands():
    x, w, grad = _data()
    got = _run(Fp8GroupedLinear(E, N, K, Fp8Config()), x, w, grad)
    for g, want in zip(got, _reference(x, w, grad)):
        _close(g, want)
    assert torch.equal(got[2][1], torch.zeros(N, K))             # expert 1 saw no rows: no gradient


def test_an_expert_multiplies_only_its_own_rows():
    x, w, grad = _data(1)
    w2 = w.clone()
    w2[3] = 0                     # expert 3 owns rows 12..20; the other rows must not change
    layer = Fp8GroupedLinear(E, N, K, Fp8Config())
    y, y2 = layer(x, w, torch.tensor(OFFS, dtype=torch.int32)), layer(x, w2, torch.tensor(OFFS, dtype=torch.int32))
    assert torch.equal(y[:12], y2[:12]) and torch.equal(y2[12:], torch.zeros(8, N))


def test_output_dtype_follows_autocast_and_the_state_records_once_per_backward():
    x, w, grad = _data()
    w.requires_grad_()
    layer = Fp8GroupedLinear(E, N, K, Fp8Config.parse("delayed(history=4)"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, w, torch.tensor(OFFS, dtype=torch.int32))
    assert y.dtype == torch.bfloat16
    assert torch.equal(layer.input_history, torch.zeros(4))        # a forward alone records nothing
    y.float().backward(grad)
    assert layer.input_history[0].item() == x.abs().max().item()
    assert layer.weight_history[0].item() == w.detach().abs().max().item()
    assert layer.grad_output_history[0].item() == pytest.approx(grad.abs().max().item(), rel=2**-8)
    with torch.no_grad():
        layer.eval()
        layer(x, w, torch.tensor(OFFS, dtype=torch.int32))        # evaluation leaves the state alone
    saved = layer.fp8_state()
    other = Fp8GroupedLinear(E, N, K, Fp8Config.parse("delayed(history=4)"))
    other.load_fp8_state(saved)
    assert all(torch.equal(other.fp8_state()[k], v) for k, v in saved.items())


def test_the_wrong_weight_shape_and_a_blocked_scaling_are_refused_with_the_fix():
    layer = Fp8GroupedLinear(E, N, K, Fp8Config())
    with pytest.raises(ValueError, match=r"\(4, 32, 48\) \(experts, out, in\)"):
        layer(torch.randn(3, K), torch.randn(E, K, N), torch.tensor([1, 2, 3, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="per-tensor scaling only"):
        Fp8GroupedLinear(E, N, K, Fp8Config.parse("mxfp8"))


def test_grouped_mm_f32_matches_a_loop_on_both_layouts():
    x, w, grad = _data(2)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    y = grouped_mm_f32(x, w.transpose(1, 2), offs)
    gw = grouped_mm_f32(grad.t(), x, offs)
    start = 0
    for e, end in enumerate(OFFS):
        assert torch.allclose(y[start:end], x[start:end] @ w[e].T, rtol=1e-6, atol=1e-5)
        assert torch.allclose(gw[e], grad[start:end].T @ x[start:end], rtol=1e-6, atol=1e-9)
        start = end


def test_compiled_fullgraph_gives_the_eager_numbers():
    x, w, grad = _data(3)
    eager = _run(Fp8GroupedLinear(E, N, K, Fp8Config()), x, w, grad)
    torch._dynamo.reset()
    compiled = torch.compile(Fp8GroupedLinear(E, N, K, Fp8Config()), backend="aot_eager", fullgraph=True)
    for a, b in zip(eager, _run(compiled, x, w, grad)):
        assert torch.equal(a, b)

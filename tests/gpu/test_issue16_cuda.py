"""CUDA checks for the models-people-train fixes: GPT-2's Conv1D through torch._scaled_mm, fp8 under
activation checkpointing with the real fp8 kernels, the fp8 probe after a fake-tensor trace, and the
per-buffer decisions on CUDA tensors. The GPU machines have no transformers: Conv1D is a stand-in
with HF's exact code (is_hf_conv1d recognises it by its module and attributes)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixprec import MixedPrecision, memory_report
from mixprec.fp8 import Fp8Conv1D, Fp8Linear, is_hf_conv1d
from mixprec.devices import _probe
from mixprec.recipe import Fp8Config

from conftest import fp8_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D, verbatim in behaviour: y = x @ W + b, W stored (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"


def test_conv1d_through_scaled_mm_equals_fp8_linear_over_the_transpose():
    fp8_gpu()
    torch.manual_seed(0)
    conv = Conv1D(96, 64).cuda()
    assert is_hf_conv1d(conv)
    linear = nn.Linear(64, 96).cuda()
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    cfg = Fp8Config.parse("delayed")
    a = Fp8Conv1D.from_conv1d(conv, cfg, backend="scaled_mm")
    b = Fp8Linear.from_linear(linear, cfg, backend="scaled_mm")
    x = torch.randn(3, 7, 64, device="cuda")                     # M = 21: the padded weight-grad path
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ya, yb = a(xa), b(xb)
        assert torch.equal(ya, yb)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(conv.weight.grad, linear.weight.grad.t())


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_fp8_delayed_equals_plain_with_the_real_kernels(reentrant):
    fp8_gpu()
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        blocks = nn.ModuleList([Block(), Block()]).cuda()
        mp = MixedPrecision(blocks, torch.optim.AdamW(blocks.parameters(), lr=1e-2),
                            "compute=bf16,fp8=delayed(backend=scaled_mm)")
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            x = torch.randn(32, 64, device="cuda", generator=g, requires_grad=True)
            with mp.autocast():
                h = x
                for blk in blocks:
                    h = checkpoint(blk, h, use_reentrant=reentrant) if ckpt else blk(h)
                loss = h.float().pow(2).mean()
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
        results.append(([p.detach().clone() for p in blocks.parameters()],
                         blocks[0].down.input_history.clone()))
    (params_a, hist_a), (params_b, hist_b) = results
    assert all(torch.equal(p, q) for p, q in zip(params_a, params_b))
    assert torch.equal(hist_a, hist_b) and hist_b.count_nonzero() == 3


def test_memory_report_before_an_engine_leaves_the_cuda_probe_real():
    fp8_gpu()
    _probe.cache_clear()
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    memory_report(model, "fp8", torch.randn(32, 64, device="cuda"))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    assert mp.fp8_report.backend == "scaled_mm"


def test_rotary_frequencies_stay_fp32_on_cuda():
    m = nn.Module()
    m.lin = nn.Linear(8, 8)
    m.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 128, 2).float() / 128))
    m.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), diagonal=1))
    m = m.cuda()
    before = m.inv_freq.clone()
    MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "bf16-pure")
    assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, before)
    assert m.mask.dtype == torch.bfloat16

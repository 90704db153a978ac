"""CUDA checks for the chunked pure step's norm (issue 13, session 4): read from the 16-bit gradients
without a host sync, within fp32 rounding of the exact norm, and a chunked step (fused or generic, a
planted overflow included) bitwise the one-call step, each gradient cast to fp32 once."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.step.grad_norm import GradNorm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def test_norm_of_16bit_gradients_is_sync_free_and_within_fp32_rounding():
    g = torch.Generator(device="cuda").manual_seed(0)
    grads = [(torch.randn(1 << 20, device="cuda", generator=g) * 300).half(),
             (torch.randn(4097, device="cuda", generator=g) * 1e-3).bfloat16(),
             torch.randn(33, device="cuda", generator=g)]
    norm = GradNorm()
    norm(grads)                                          # warm-up: lazy kernel loading may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = norm(grads)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exact = math.sqrt(sum(float(t.double().square().sum()) for t in grads))
    assert out.dtype == torch.float32 and out.item() == pytest.approx(exact, rel=1e-5)
    bad = grads[0].clone()
    bad[12345] = math.inf
    assert not torch.isfinite(norm([bad] + grads[1:]))


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 8)).cuda()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 8, (32,), device="cuda")
    return model, x, y


OPTIMIZERS = {
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_chunked_step_is_the_one_call_step_bitwise_with_a_planted_overflow(recipe, opt_name):
    model, x, y = model_and_data()
    twin = copy.deepcopy(model)
    engines = []
    for m, chunk in ((model, None), (twin, 64 * 1024)):   # 64 KiB: the 256x256 weight alone, and so on
        mp = mixprec.MixedPrecision(m, OPTIMIZERS[opt_name](m.parameters()), recipe, clip_grad_norm=0.5)
        if chunk is not None:
            mp.master.chunk_bytes = chunk
        engines.append(mp)
    casts: list[int] = []
    real = engines[1].master._pull       # every cast into the fp32 copies goes through it

    def counting(which, chunked, buffer):
        casts.extend(which)
        return real(which, chunked, buffer)

    engines[1].master._pull = counting
    skipped = {0: [], 1: []}
    for step in range(4):
        casts.clear()
        for k, mp in enumerate(engines):
            with mp.autocast():
                mp.backward(F.cross_entropy(mp.model(x), y))
            if step == 1:
                mp.model[3].weight.grad.view(-1)[9] = math.inf
            skipped[k].append(mp.step().skipped)
            mp.zero_grad()
        # Every fp32 copy cast once per step (the norm reads the 16-bit gradients); a generic
        # optimizer's skipped step casts nothing, a fused one steps (and skips) in its kernels.
        assert sorted(casts) == ([] if skipped[1][-1] and opt_name != "adamw-fused"
                                 else list(range(len(engines[1].master.masters))))
    assert skipped[0] == skipped[1] == [False, True, False, False]
    assert engines[1].master._plan(engines[1].optimizer) is not None      # several chunks
    for a, b in zip(list(model.state_dict().values()) + engines[0].master.masters,
                    list(twin.state_dict().values()) + engines[1].master.masters):
        assert torch.equal(a, b)

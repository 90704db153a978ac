"""CUDA checks for issue 13: chunked pure steps stay fused and sync-free and lower the step's peak by the
fp32 gradients they no longer hold; compact moments and 16-bit saves on the GPU; prediction within 1%."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import memory_report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def model_and_data(width=1024):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, width),
                          nn.GELU(), nn.Linear(width, 16)).cuda()
    x = torch.randn(64, 256, device="cuda")
    y = torch.randint(0, 16, (64,), device="cuda")
    return model, x, y


def run(mp, x, y, steps=3):
    for _ in range(steps):
        with mp.autocast():
            mp.backward(F.cross_entropy(mp.model(x), y))
        mp.step()
        mp.zero_grad()


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure", "bf16-sr"])
def test_chunked_fused_step_is_sync_free_and_equals_one_chunk(recipe):
    model, x, y = model_and_data()
    twin = copy.deepcopy(model)
    one = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe,
                                 clip_grad_norm=1.0)
    many = mixprec.MixedPrecision(twin, torch.optim.AdamW(twin.parameters(), fused=True), recipe,
                                  clip_grad_norm=1.0)
    many.master.chunk_bytes = 1 << 20            # 1 MiB: several chunks
    run(one, x, y, 2)
    run(many, x, y, 2)                           # warm-up: lazy state creation may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(one, x, y, 2)
        run(many, x, y, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)


def test_chunks_lower_the_step_peak_by_the_fp32_gradients():
    peaks = {}
    for chunk in (1 << 40, 1 << 20):
        model, x, y = model_and_data(width=2048)
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), "bf16-pure")
        mp.master.chunk_bytes = chunk
        run(mp, x, y, 1)
        with mp.autocast():
            mp.backward(F.cross_entropy(model(x), y))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        mp.step()
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - before
    n = sum(p.numel() for p in mp.master.model_params)
    # One chunk casts every gradient into fp32 at once (4 B/param of transients); 1 MiB chunks hold at
    # most the largest tensor's fp32 gradient (2048x2048x4 = 16 MiB) at a time.
    assert peaks[1 << 40] >= 4 * n
    assert peaks[1 << 20] <= peaks[1 << 40] - 4 * n + 4 * 2048 * 2048 + (1 << 20)


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure", "bf16-sr,moments=bf16-sr", "bf16,saved=low"])
def test_predicted_memory_within_one_percent_on_cuda(recipe):
    model, x, y = model_and_data()
    r = memory_report(model, recipe, (x, y), optimizer=lambda p: torch.optim.AdamW(p, fused="moments" not in recipe),
                      loss_fn=F.cross_entropy, measure=True)
    p, m = r.predicted, r.measured
    assert (p.params, p.grads, p.master, p.optimizer) == (m.params, m.grads, m.master, m.optimizer)
    assert abs(p.activations - m.activations) <= 0.01 * m.activations


def test_bf16_moments_resume_bit_for_bit_on_cuda():
    model, x, y = model_and_data()
    twin = copy.deepcopy(model)
    a = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-sr,moments=bf16-sr")
    run(a, x, y, 2)
    b = mixprec.MixedPrecision(twin, torch.optim.AdamW(twin.parameters()), "bf16-sr,moments=bf16-sr")
    b.model.load_state_dict(a.model.state_dict())
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    run(a, x, y, 2)
    run(b, x, y, 2)
    for u, v in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(u, v)


@pytest.mark.parametrize("recipe", ["bf16-pure", "bf16"])
def test_exact_saves_train_bit_for_bit_on_cuda(recipe):
    model, x, y = model_and_data()
    twin = copy.deepcopy(model)
    a = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), recipe + ",saved=exact")
    b = mixprec.MixedPrecision(twin, torch.optim.AdamW(twin.parameters()), recipe + ",saved=fp32")
    run(a, x, y, 3)
    run(b, x, y, 3)
    for u, v in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(u, v)


def test_chunked_cross_entropy_gradient_equals_autocasts_and_its_peak_is_chunk_sized():
    rows, vocab = 2048, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = F.cross_entropy(x, t)            # CUDA autocast: log_softmax in fp32 from the bf16 logits
    (want,) = torch.autograd.grad(ref, x)
    got = mixprec.cross_entropy(x, t)
    (have,) = torch.autograd.grad(got, x)
    if not torch.equal(have, want):
        # Bitwise on the H100 of 2026-11-22; on the H200's torch 2.11 (2026-11-28) 95.5M of 103M
        # elements differed, by up to 1.9e-6 (several bf16 ulps on tiny probabilities), as if one side
        # took the log-sum-exp in less than fp32. Then ours must be the closer to the exact gradient.
        xd = x.detach().double().requires_grad_()
        (exact,) = torch.autograd.grad(F.cross_entropy(xd, t), xd)
        ours, theirs = (have.double() - exact).abs(), (want.double() - exact).abs()
        diff = (have != want).sum()
        assert ours.mean() <= theirs.mean() and ours.max() <= theirs.max(), (
            f"gradients differ at {int(diff)} of {have.numel()} elements; error against fp64: ours mean "
            f"{float(ours.mean()):.3g} max {float(ours.max()):.3g}, autocast's mean {float(theirs.mean()):.3g} "
            f"max {float(theirs.max()):.3g}")
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)

    def backward_peak(loss_fn):
        loss = loss_fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.autograd.grad(loss, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    full = rows * vocab * 4
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = backward_peak(lambda: F.cross_entropy(x, t))
    chunked = backward_peak(lambda: mixprec.cross_entropy(x, t))
    # torch: the saved fp32 log-probabilities are already counted in `before`; the backward adds an
    # fp32 gradient (and the bf16 result). Chunked: the bf16 result and three 32 MiB fp32 chunks.
    assert plain >= full
    assert chunked <= full // 2 + 3 * (32 << 20) + (8 << 20)

"""CUDA-only checks: fp16/bf16 steps on the GPU without a host sync, and the fused path used there."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.GELU(), nn.Linear(512, 16)).cuda()
    x = torch.randn(64, 256, device="cuda")
    y = torch.randint(0, 16, (64,), device="cuda")
    return model, x, y


@pytest.mark.parametrize("recipe", ["fp16", "bf16", "fp16-pure", "bf16-pure", "bf16-sr", "tf32"])
def test_fused_step_runs_without_host_sync(recipe, no_sync):
    model, x, y = model_and_data()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe,
                                clip_grad_norm=1.0)
    for _ in range(2):                       # warm-up: lazy state creation may sync
        with mp.autocast():
            mp.backward(F.cross_entropy(model(x), y))
        mp.step()
        mp.zero_grad()
    with no_sync():
        for _ in range(3):
            with mp.autocast():
                loss = F.cross_entropy(model(x), y)
            mp.backward(loss)
            result = mp.step()
            mp.zero_grad()
    assert not result.skipped and torch.isfinite(loss)


@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure"])
def test_planted_overflow_skips_on_gpu(recipe):
    model, x, y = model_and_data()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe)
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    result = mp.step()
    assert result.skipped and result.scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_matches_fp32_on_gpu():
    finals = {}
    for recipe in ("fp32", "fp16"):
        model, x, y = model_and_data()
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.05), recipe)
        for _ in range(20):
            with mp.autocast():
                mp.backward(F.cross_entropy(model(x), y))
            mp.step()
            mp.zero_grad()
        finals[recipe] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (finals["fp16"] - finals["fp32"]).norm() / finals["fp32"].norm() < 5e-3


def test_compare_on_cuda_records_the_allocator_peak(tmp_path):
    from mixprec.lab.compare.run import plan_compare, run_compare
    report = run_compare(plan_compare("mlp", ["fp32", "bf16", "fp16"], steps=30, device="cuda"))
    for run in report.runs:
        assert run.memory.peak is not None and run.memory.peak >= run.memory.params
        assert run.skipped_steps == 0 and run.test_metric > 0.5


@pytest.mark.parametrize("recipe, precision", [("fp32", "ieee"), ("tf32", "tf32")])
def test_fp32_recipes_run_forward_and_backward_at_their_tf32_setting(recipe, precision, monkeypatch):
    # torch's defaults put cuDNN convolutions in TF32: before, the fp32 recipe's backward ran its
    # convolutions so, and tf32's backward ran cuBLAS matmuls in IEEE fp32. Both gradients must now
    # be those of a loop that sets the switches for the whole step.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    knobs = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    saved = [k.fp32_precision for k in knobs]

    def conv_net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 14 * 14, 10)).cuda()

    x, y = torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    theirs = conv_net()
    try:
        for k in knobs:
            k.fp32_precision = precision
        F.cross_entropy(theirs(x), y).backward()
        for k in knobs:               # the opposite setting around the engine: it must not matter
            k.fp32_precision = "tf32" if precision == "ieee" else "ieee"
        ours = conv_net()
        mp = mixprec.MixedPrecision(ours, torch.optim.SGD(ours.parameters(), lr=0.1), recipe)
        with mp.autocast():
            loss = F.cross_entropy(ours(x), y)
        mp.backward(loss)
        for a, b in zip(theirs.parameters(), ours.parameters()):
            assert torch.equal(a.grad, b.grad)
    finally:
        for k, was in zip(knobs, saved):
            k.fp32_precision = was

"""Accelerate's optimizer wrapper does not hide torch's fused path: a fused AdamW prepared by
Accelerate steps in its kernel (no host sync) and trains bit for bit as the unwrapped one."""

import pytest
import torch
import torch.nn.functional as F
from optional_deps import need
from torch import nn

need("accelerate")
from accelerate import Accelerator  # noqa: E402

import mixprec  # noqa: E402
import mixprec.engine  # noqa: E402
from mixprec.step.optimizer import fused_kernel_optimizer, fused_step_ok  # noqa: E402

STEPS = 6
POISONED = 2                # this step's loss is inf: the fused kernel must skip it


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def _train(mp, net):
    g = torch.Generator().manual_seed(1)
    for i in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with mp.autocast():
            loss = F.cross_entropy(net(x), y)
        mp.backward(loss * float("inf") if i == POISONED else loss)
        mp.step()
        mp.zero_grad()


@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure"])
def test_the_wrapped_fused_adamw_takes_the_fused_path_and_trains_alike(recipe, monkeypatch):
    plain = _net()
    mp_plain = mixprec.MixedPrecision(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True),
                                      recipe, clip_grad_norm=1.0)
    _train(mp_plain, plain)

    accelerator = Accelerator(cpu=True)
    net = _net()
    net, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True))
    assert type(opt).__name__ == "AcceleratedOptimizer" and not hasattr(opt, "_step_supports_amp_scaling")
    mp = mixprec.MixedPrecision(net, opt, recipe, clip_grad_norm=1.0)
    assert fused_kernel_optimizer(opt) is opt.optimizer and fused_step_ok(mp)

    def no_generic(*args, **kwargs):
        raise AssertionError("the generic path (one host sync) ran")

    monkeypatch.setattr(mixprec.engine, "generic_optimizer_step", no_generic)
    _train(mp, net)
    for p, q in zip(net.parameters(), plain.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
    assert mp.scale == mp_plain.scale == 2.0**15                      # the inf step halved it, once
    assert not hasattr(opt.optimizer, "grad_scale") and not hasattr(opt.optimizer, "found_inf")
    assert opt.optimizer.state[opt.param_groups[0]["params"][0]]["step"].item() == STEPS - 1   # one skipped


def test_the_wrapper_is_looked_through_only_when_it_only_passes_the_step_on():
    accelerator = Accelerator(cpu=True)
    net = _net()
    opt = accelerator.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True))
    assert fused_kernel_optimizer(opt) is opt.optimizer
    # Inside accelerator.accumulate on a micro-batch that does not sync, the wrapper skips the step.
    opt.gradient_state._set_sync_gradients(False)
    try:
        assert fused_kernel_optimizer(opt) is None
    finally:
        opt.gradient_state._set_sync_gradients(True)
    opt.scaler = torch.amp.GradScaler("cpu")        # Accelerate's own fp16 scaler: its step, not ours
    assert fused_kernel_optimizer(opt) is None
    opt.scaler = None
    # An unfused AdamW has no fused kernel to find, wrapped or not: the generic path.
    unfused_net = _net()
    unfused = accelerator.prepare(torch.optim.AdamW(unfused_net.parameters(), lr=1e-2))
    assert fused_kernel_optimizer(unfused) is None
    assert not fused_step_ok(mixprec.MixedPrecision(unfused_net, unfused, "fp16"))

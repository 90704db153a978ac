"""fp8 under activation checkpointing: each real forward enters the amax history once, and the
recompute casts exactly as the forward did, so a checkpointed run equals the plain one bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixprec import MixedPrecision


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """Two residual MLP blocks, each optionally checkpointed (reentrant or not)."""

    def __init__(self, mode):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 16)
        self.mode = mode

    def forward(self, x):
        for block in self.blocks:
            if self.mode is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


def _run(mode, recipe, steps=3):
    torch.manual_seed(0)
    model = Net(mode)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    g = torch.Generator().manual_seed(1)
    histories = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g, requires_grad=True)   # reentrant needs a grad-requiring input
        y = torch.randn(8, 16, generator=g)
        with mp.autocast():
            loss = F.mse_loss(model(x), y)
        mp.backward(loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        mp.step()
        mp.zero_grad()
        histories.append(model.blocks[0].down.input_history.clone() if "delayed" in recipe else None)
    return model, grads, histories


# saved=exact: a checkpointed segment saves nothing in its forward and recomputes in the backward, where
# saved=low (the default) has nothing to round, so only the lossless policy makes the two runs comparable
# bit for bit.
DELAYED = "compute=bf16,fp8=delayed(history=4,backend=emulate),saved=exact"
CURRENT = "compute=bf16,fp8=current(backend=emulate),saved=exact"


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_delayed_history_gets_one_amax_per_step_under_checkpointing(mode):
    _, _, plain = _run(None, DELAYED, steps=1)
    _, _, ckpt = _run(mode, DELAYED, steps=1)
    # One step, one record: [a, 0, 0, 0] (before the fix: [a, a, 0, 0] without reentrancy).
    assert ckpt[0][0] > 0 and ckpt[0][1:].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(ckpt[0], plain[0])


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_training_equals_plain_training_bit_for_bit(mode, recipe):
    model_a, grads_a, hist_a = _run(None, recipe)
    model_b, grads_b, hist_b = _run(mode, recipe)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), name
    if recipe == DELAYED:
        assert all(torch.equal(a, b) for a, b in zip(hist_a, hist_b))
        assert hist_b[-1].count_nonzero() == 3                      # three steps, three amaxes


def test_a_forward_without_backward_leaves_the_scale_state_alone():
    torch.manual_seed(0)
    model = Net(None)
    MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), DELAYED)
    model(torch.randn(4, 32))                                      # training mode, grad on, no backward
    assert model.blocks[0].up.input_history.count_nonzero() == 0

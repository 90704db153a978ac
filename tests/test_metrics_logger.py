"""MetricsLogger: the loss scale, skips and grad norm of each step, and per-layer range fractions,
to a SummaryWriter-like object or a function."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision
from mixprec.diagnostics import RangeCollector
from mixprec.integrations.logging import MetricsLogger


class Writer:
    """Stands in for torch.utils.tensorboard.SummaryWriter: only add_scalar is used."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def _engine(recipe="fp16"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)


def _step(model, mp, poison=False):
    with mp.autocast():
        loss = F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4))
    mp.backward(loss)
    if poison:
        model[0].weight.grad[0, 0] = float("inf")       # an overflow: the step is skipped
    result = mp.step()
    mp.zero_grad()
    return result


def test_steps_reach_the_writer_with_the_skip_and_the_halved_scale():
    model, mp = _engine()
    writer = Writer()
    metrics = MetricsLogger(writer)
    for i, poison in enumerate([False, True, False]):
        result = _step(model, mp, poison)
        metrics.log_step(mp, result, step=10 + i)
    got = {(tag, step): value for tag, value, step in writer.scalars}
    assert got[("mixprec/loss_scale", 10)] == 65536.0 and got[("mixprec/loss_scale", 11)] == 32768.0
    assert got[("mixprec/skipped", 11)] == 1.0 and got[("mixprec/skipped", 12)] == 0.0
    assert got[("mixprec/skipped_steps", 12)] == 1.0
    assert math.isinf(got[("mixprec/grad_norm", 11)]) and 0 < got[("mixprec/grad_norm", 12)] < 100


def test_every_k_and_a_function_sink():
    model, mp = _engine("bf16")
    seen = []
    metrics = MetricsLogger(lambda m, step: seen.append((step, m)), every=2, prefix="mp/")
    for _ in range(5):
        metrics.log_step(mp, _step(model, mp))
    assert [s for s, _ in seen] == [0, 2, 4] and set(seen[0][1]) == {"mp/loss_scale", "mp/skipped",
                                                                    "mp/skipped_steps", "mp/grad_norm"}


def test_range_fractions_per_layer_match_the_collector():
    model, mp = _engine()
    collector = RangeCollector(mp)
    with collector.collecting():
        _step(model, mp)
    ranges = collector.result()
    seen = []
    logged = MetricsLogger(lambda m, step: seen.append(m)).log_ranges(ranges, step=0, fmt="fp16")
    stats = ranges.module("0").stats["activations"]
    assert logged["ranges/0/activations/underflow"] == stats.fraction("fp16", "flush")
    assert logged["ranges/0/activations/overflow"] == stats.fraction("fp16", "overflow")
    assert "mixprec/ranges/2/weight_grads/underflow" in seen[0]


def test_a_sink_without_add_scalar_or_call_is_refused():
    with pytest.raises(TypeError, match="SummaryWriter"):
        MetricsLogger(object())


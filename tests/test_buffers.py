"""Buffers under pure recipes: tables a cast would round stay exact, running statistics stay fp32."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec import MixedPrecision
from mixprec.casting.buffers import cast_buffers, decide_buffer


def _inv_freq(head_dim: int = 128, base: float = 10000.0) -> torch.Tensor:
    # The rotary frequencies of Llama-style models: base ** (-2i / head_dim), i = 0 .. head_dim/2 - 1.
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


class Rotary(nn.Module):
    """A rotary attention-ish block: an fp32 frequency table, a causal mask, a linear, a BatchNorm1d
    that a modules= rule puts in bf16 (so only the buffer rules keep its running stats fp32)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(), persistent=False)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), diagonal=1))
        self.proj = nn.Linear(64, 64)
        self.bn = nn.BatchNorm1d(64)

    def forward(self, pos):                                         # pos: (T,) int64
        angle = pos[:, None].float() * self.inv_freq[None, :]       # (T, 64) fp32 when inv_freq is
        return self.bn(self.proj(torch.cos(angle) + self.mask.sum()))


def test_the_issue_numbers_a_bf16_inv_freq_is_off_by_radians_at_long_positions():
    inv = _inv_freq()
    err = {pos: float((pos * inv.bfloat16().float() - pos * inv).abs().max()) for pos in (512, 2048, 8191)}
    assert err[512] == pytest.approx(0.626, abs=1e-3) and err[8191] == pytest.approx(10.02, abs=1e-2)


@pytest.mark.parametrize("recipe", ["bf16-pure", "fp16-pure", "bf16-sr"])
def test_pure_recipes_keep_the_frequency_table_exact_and_cast_the_exact_mask(recipe):
    torch.manual_seed(0)
    model = Rotary()
    inv_before = model.inv_freq.clone()
    MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    assert model.proj.weight.dtype != torch.float32                      # the weights are cast
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, inv_before)
    assert model.mask.dtype == model.proj.weight.dtype                   # 0 and -inf: exact, cast
    assert "inv_freq" in model._non_persistent_buffers_set               # persistence kept
    # The position angle at 8191 is the fp32 one, bit for bit.
    pos = torch.tensor([8191])
    assert torch.equal(pos[:, None].float() * model.inv_freq, pos[:, None].float() * _inv_freq())


def test_running_statistics_stay_fp32_even_in_a_16_bit_region():
    model = Rotary()
    MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure,modules=bn:bf16")
    assert model.bn.weight.dtype == torch.bfloat16                       # the rule put its weights in bf16
    assert {model.bn.running_mean.dtype, model.bn.running_var.dtype} == {torch.float32}
    assert model.bn.num_batches_tracked.dtype == torch.int64


def test_decisions_say_why_and_values_that_round_or_overflow_stay():
    m = nn.Module()
    m.register_buffer("ones", torch.ones(3))
    m.register_buffer("third", torch.full((2,), 1 / 3))
    m.register_buffer("big", torch.tensor([70000.0]))     # above fp16's max 65504: would become inf
    m.register_buffer("nan_pad", torch.tensor([float("nan"), 0.5]))
    m.register_buffer("ids", torch.arange(3))
    got = {d.name: (d.cast, d.reason) for d in cast_buffers(m, torch.float16)}
    assert set(got) == {"ones", "third", "big", "nan_pad"}                # integers are not considered
    assert got["ones"][0] and got["nan_pad"][0]
    assert not got["third"][0] and "round" in got["third"][1]
    assert not got["big"][0] and m.big.dtype == torch.float32
    assert m.ones.dtype == torch.float16 and m.ids.dtype == torch.int64


def test_a_buffer_shared_by_two_modules_is_decided_once_and_stays_shared():
    table = torch.zeros(4)
    a, b = nn.Module(), nn.Module()
    a.register_buffer("t", table)
    b.register_buffer("t", table)
    root = nn.ModuleDict({"a": a, "b": b})
    decisions = cast_buffers(root, torch.bfloat16)
    assert len(decisions) == 1 and root["a"].t is root["b"].t and root["b"].t.dtype == torch.bfloat16


def test_meta_and_fake_buffers_are_kept_as_they_are():
    m = nn.Module()
    m.register_buffer("x", torch.ones(2, device="meta"))
    assert decide_buffer(m, "x", m.x, torch.bfloat16) == (False, "values unknown (meta or fake tensor): "
                                                                 "kept as it is")
    with FakeTensorMode():
        fake = torch.ones(2)
        assert decide_buffer(m, "x", fake, torch.bfloat16)[0] is False


def test_fp8_scale_state_stays_fp32_under_a_pure_base():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        "params=bf16,compute=bf16,master=fp32,fp8=delayed(backend=emulate)")
    assert mp.fp8_report.swapped
    layer = model[0]
    assert all(buf.dtype in (torch.float32, torch.int64) for buf in layer.buffers())
    with mp.autocast():
        loss = F.mse_loss(model(torch.randn(4, 32)), torch.zeros(4, 32))
    mp.backward(loss)
    mp.step()
    assert layer.input_history.dtype == torch.float32 and float(layer.input_history[0]) > 0

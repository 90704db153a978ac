"""Stochastic rounding is unbiased and exact where it should be; bf16-sr keeps learning where bf16 stops."""

import math

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.master import stochastic_round_bf16


@pytest.mark.parametrize("value, frac_up", [(1 + 2**-10, 1 / 8), (-(1 + 3 * 2**-9), 3 / 4), (3e-3, None)])
def test_stochastic_rounding_is_unbiased(value, frac_up):
    n = 200_000
    x = torch.full((n,), value)
    out = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    # The two bf16 neighbours: the fp32 pattern with its low 16 bits cleared, and one bf16 ulp further out.
    bits = torch.tensor([value]).view(torch.int32) & -65536
    lo, hi = bits.view(torch.float32).item(), (bits + 65536).view(torch.float32).item()
    assert set(out.unique().tolist()) <= {lo, hi}
    # The mean lands within 5 standard errors of the true value: unbiased, measured statistically.
    sigma = abs(hi - lo) * math.sqrt(0.25 / n)
    assert abs(out.double().mean().item() - value) < 5 * sigma
    if frac_up is not None:
        assert abs((out != lo).double().mean().item() - frac_up) < 5 * math.sqrt(frac_up * (1 - frac_up) / n)


def test_stochastic_rounding_leaves_representable_values_and_specials_alone():
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, math.inf, -math.inf, math.nan]).bfloat16().float()
    out = stochastic_round_bf16(x, torch.Generator().manual_seed(1)).float()
    assert torch.equal(out[:-1].view(torch.int32), x[:-1].view(torch.int32)) and out[-1].isnan()


def test_bf16_sr_keeps_learning_where_nearest_rounding_stops():
    # Updates of 1e-3 against |w| = 1 are below half a bf16 ulp (2**-8): round-to-nearest drops every
    # one. Stochastic rounding applies them on average.
    final = {}
    for recipe in ("params=bf16,compute=bf16,master=none", "bf16-sr"):
        model = nn.Linear(256, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), recipe)
        for _ in range(100):
            with mp.autocast():
                loss = model(torch.ones(1, 256)).sum()    # every weight's gradient is 1
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
        final[recipe] = model.weight.float().mean().item()
    assert final["params=bf16,compute=bf16,master=none"] == 1.0
    assert abs(final["bf16-sr"] - 0.9) < 0.01        # 1 - 100 * 1e-3, up to rounding noise


def test_bf16_sr_holds_no_fp32_copy_between_steps():
    model = nn.Linear(64, 64)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-sr")
    with mp.autocast():
        mp.backward(model(torch.randn(4, 64)).square().mean())
    mp.step()
    assert all(m.numel() == 0 for m in mp.master.masters)
    state = mp.optimizer.state[mp.master.masters[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == (64, 64)

"""fp32 export: under pure recipes mp.fp32_state_dict() holds the master weights, not the 16-bit ones."""

import pytest
import torch
import torch.nn.functional as F

from mixprec import MixedPrecision

from conftest import batches, tiny_model


def trained(recipe):
    model = tiny_model()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    for x, y in batches(3):
        with mp.autocast():
            loss = F.cross_entropy(mp.model(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return mp


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure"])
def test_pure_recipes_export_the_masters_bit_for_bit(recipe):
    mp = trained(recipe)
    state = mp.fp32_state_dict()
    assert list(state) == list(mp.model.state_dict()) and all(v.dtype == torch.float32 for v in state.values())
    masters = {id(p): m for p, m in zip(mp.master.model_params, mp.master.masters)}
    for name, p in mp.model.named_parameters():
        if p.dtype != torch.float32:      # a 16-bit weight: its master, which differs from its rounding
            assert torch.equal(state[name], masters[id(p)])
        else:                             # LayerNorm stays fp32 in pure recipes: itself
            assert torch.equal(state[name], p)
    # The masters carry information the 16-bit weights lost (else this test would prove nothing).
    w16 = mp.model.state_dict()["0.weight"]
    assert w16.dtype != torch.float32 and not torch.equal(state["0.weight"], w16.float())
    # An fp32 model loads it (strict: same keys) and then holds exactly the masters.
    fp32 = tiny_model(seed=9)
    fp32.load_state_dict(state)
    assert all(torch.equal(fp32.state_dict()[k], v) for k, v in state.items())

def test_bf16_sr_exports_its_bf16_weights_upcast_exactly():
    mp = trained("bf16-sr")
    state = mp.fp32_state_dict()
    for name, v in mp.model.state_dict().items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], v.float())


def test_non_pure_recipes_export_the_model_state_unchanged():
    mp = trained("fp16")
    state = mp.fp32_state_dict()
    assert all(torch.equal(state[k], v) and v.dtype == torch.float32 for k, v in mp.model.state_dict().items())

"""A checkpoint with a valid checksum but values no run can produce is refused, the field named, and
nothing changed (issue 33): negative second moments, non-finite optimizer state, a loss scale outside
[floor, ceiling], clean_steps at growth_interval, fp8 scales and Hadamard signs, Kahan pairs."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import batches, same_nested as _same, tiny_model
from torch import nn

from mixprec import CheckpointError, MixedPrecision, load_checkpoint, save_checkpoint
from mixprec.checkpoint.verified import read_verified, write_verified


def _train(recipe, opt=torch.optim.AdamW, steps=2, model=None, seed=1):
    model = model or tiny_model(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp = MixedPrecision(model, opt(model.parameters(), lr=1e-2), recipe)
    for x, y in batches(steps, seed=seed):
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return mp


def _fp8_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _everything(mp):
    return copy.deepcopy((mp.model.state_dict(), mp.optimizer.state_dict(), mp.state_dict()))



def _opt_state(key, value):
    def damage(state):
        state["optimizer"]["state"][0][key].view(-1)[0] = value
    return damage


def _scale(key, value):
    def damage(state):
        state["mixprec"]["loss_scale"][key].fill_(value)
    return damage


def _fp8(key, value):
    def damage(state):
        layers = state["mixprec"]["fp8"]
        assert layers, "no fp8 layer: the test model must have one"
        next(iter(layers.values()))[key].view(-1)[0] = value
    return damage


def _compact(key, value):
    def damage(state):
        m = state["mixprec"]["moments"]["state"][0][key]
        (m[0] if isinstance(m, tuple) else m).view(-1)[0] = value
    return damage


def _kahan_negative_on_zero(state):
    key = "0.weight"
    state["model"][key].view(-1)[0] = 0.0
    state["mixprec"]["master"]["compensation"][0].view(-1)[0] = -5


CASES = [
    # (recipe, optimizer, damage, words in the message)
    ("fp16-pure", torch.optim.AdamW, _opt_state("exp_avg_sq", -1e-3), ["'exp_avg_sq' of parameter 0", "negative"]),
    ("bf16", torch.optim.Adam, _opt_state("exp_avg_sq", -1.0), ["'exp_avg_sq'", "negative"]),
    ("bf16", torch.optim.Adagrad, _opt_state("sum", -2.0), ["'sum' of parameter 0", "negative"]),
    ("bf16", torch.optim.RMSprop, _opt_state("square_avg", -2.0), ["'square_avg'", "negative"]),
    ("bf16", torch.optim.AdamW, _opt_state("exp_avg", math.nan), ["'exp_avg' of parameter 0", "non-finite"]),
    ("bf16", torch.optim.AdamW, _opt_state("exp_avg_sq", math.inf), ["'exp_avg_sq'", "non-finite"]),
    ("fp16", lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), _opt_state("momentum_buffer", -math.inf),
     ["'momentum_buffer'", "non-finite"]),
    ("fp16", torch.optim.AdamW, _scale("value", 2.0**30), ["'value' is 1.07374e+09", "[floor, ceiling]"]),
    ("fp16", torch.optim.AdamW, _scale("value", 0.5), ["'value' is 0.5", "floor"]),
    ("fp16,scale=dynamic(floor=4)", torch.optim.AdamW, _scale("value", 2.0), ["[4, 1.67772e+07]"]),
    ("fp16", torch.optim.AdamW, _scale("clean_steps", 2000), ["'clean_steps' is 2000", "growth_interval 2000"]),
    ("fp16,scale=dynamic(growth_interval=10)", torch.optim.AdamW, _scale("clean_steps", 11), ["'clean_steps' is 11"]),
    ("fp16,scale=dynamic(hysteresis=2)", torch.optim.AdamW, _scale("hysteresis_left", 3), ["'hysteresis_left'"]),
    ("bf16-pure,moments=bf16", torch.optim.AdamW, _compact("exp_avg_sq", -1.0), ["compact moment 'exp_avg_sq'", "negative"]),
    ("bf16-pure,moments=bf16", torch.optim.AdamW, _compact("exp_avg", math.nan), ["compact moment 'exp_avg'", "non-finite"]),
    ("bf16-pure,moments=fp8", torch.optim.AdamW, _compact("exp_avg_sq", 0xB8), ["compact moment 'exp_avg_sq'", "negative"]),
    ("bf16-pure,moments=bf16-sr", torch.optim.AdamW, _compact("exp_avg_sq", -3.0), ["'exp_avg_sq' of tensor 0"]),
    ("bf16-kahan", torch.optim.AdamW, _kahan_negative_on_zero, ["Kahan compensation 0 holds -5", "no fp32 value"]),
]
FP8_CASES = [
    ("nvfp4", _fp8("rht_signs", 0.5), ["'rht_signs'", "+1 and -1"]),
    ("nvfp4", _fp8("rht_signs", 0.0), ["'rht_signs'"]),
    ("fp8", _fp8("input_scale", math.inf), ["'input_scale'", "non-finite"]),
    ("fp8-delayed", _fp8("input_history", math.nan), ["'input_history'", "non-finite"]),
    ("fp8-delayed", _fp8("weight_scale", -1.0), ["'weight_scale'", "<= 0"]),
    ("fp8-delayed", _fp8("input_amax", -1.0), ["'input_amax'", "negative"]),
    ("mxfp8", _fp8("input_amax", -2.0), ["'input_amax'", "negative"]),
    ("fp8-delayed", _fp8("grad_output_history", math.inf), ["'grad_output_history'", "non-finite"]),
]


def _check_refused(tmp_path, make, damage, words):
    path = save_checkpoint(tmp_path / "ck.pt", make(seed=1))
    state = read_verified(path, torch.device("cpu"))
    damage(state)
    write_verified(path, state)
    mp = make(seed=4)
    before = _everything(mp)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, mp)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert _same(before, _everything(mp))


@pytest.mark.parametrize("recipe, opt, damage, words", CASES, ids=[f"{c[0]}-{c[3][0]}" for c in CASES])
def test_a_value_no_run_produces_is_refused_by_name_and_changes_nothing(tmp_path, recipe, opt, damage, words):
    _check_refused(tmp_path, lambda seed: _train(recipe, opt, seed=seed), damage, words)


@pytest.mark.parametrize("recipe, damage, words", FP8_CASES, ids=[f"{c[0]}-{c[2][0]}" for c in FP8_CASES])
def test_an_fp8_state_no_run_produces_is_refused(tmp_path, recipe, damage, words):
    _check_refused(tmp_path, lambda seed: _train(recipe, model=_fp8_model(), seed=seed), damage, words)


@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure", "bf16-kahan", "bf16-pure,moments=fp8", "nvfp4",
                                    "fp8-delayed"])
def test_what_a_run_writes_still_loads(tmp_path, recipe):
    fp8 = recipe in ("nvfp4", "fp8-delayed")
    make = lambda s: _train(recipe, model=_fp8_model() if fp8 else None, seed=s, steps=3)   # noqa: E731
    mp = make(1)
    if fp8:
        assert mp.state_dict()["fp8"]
    path = save_checkpoint(tmp_path / "ck.pt", mp)
    resumed = make(4)
    load_checkpoint(path, resumed)
    assert _same(mp.state_dict(), resumed.state_dict())


@pytest.mark.parametrize("recipe", ["fp8", "fp8-delayed", "nvfp4"])
def test_a_skipped_fp8_step_poisons_no_scale_and_its_checkpoint_loads(tmp_path, recipe):
    # The backward of a bad step records its inf/NaN gradient amax (as Transformer Engine does):
    # the history holds it as 0 and every scale stays finite and positive (docs/fp8.md), so later
    # steps scale as if the step had seen nothing; the last-amax diagnostic keeps the NaN, and a
    # checkpoint saved right after loads (a value a run produces).
    mp = _train(recipe, model=_fp8_model())
    x, y = batches(1, seed=7)[0]
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y) * math.inf
    mp.backward(loss)
    assert mp.step().skipped
    mp.zero_grad()
    state = mp.state_dict()["fp8"]
    assert any(not torch.isfinite(s["grad_output_amax"]).all() for s in state.values())
    for s in state.values():
        for key, value in s.items():
            if key.endswith(("_scale", "_history")):
                assert torch.isfinite(value).all() and (value >= 0).all(), key
            if key.endswith("_history"):
                assert value[0] == 0 or not key.startswith("grad_output")
    path = save_checkpoint(tmp_path / "ck.pt", mp)
    load_checkpoint(path, mp)
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y)
    mp.backward(loss)
    assert not mp.step().skipped
    assert all(torch.isfinite(p).all() for p in mp.model.parameters())

"""The engine: skipped steps change nothing, fp16 tracks fp32, clipping sees unscaled gradients,
accumulation, state round trips, and bad input that names the fix."""

import copy
import math
import pickle
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, parse_recipe
from mixprec.step import optimizer as optimizer_step

from conftest import OPTIMIZERS, batches, tiny_model

RECIPES = ["fp32", "fp16", "bf16", "fp16-pure", "bf16-pure", "bf16-sr",
           "params=fp32,compute=fp16,master=none,scale=static:256",
           "params=fp32,compute=fp16,master=none,scale=dynamic(hysteresis=2)"]


def train_step(mp, x, y, plant=None):
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y)
    mp.backward(loss)
    if plant is not None:
        plant()
    result = mp.step()
    mp.zero_grad()
    return result


def snapshot(mp):
    return {"model": copy.deepcopy(mp.model.state_dict()),
            "master": [m.detach().clone() for m in mp.master.masters] if mp.master else [],
            "optimizer": copy.deepcopy(mp.optimizer.state_dict()["state"])}


def assert_bitwise_unchanged(before, after):
    for name, tensor in before["model"].items():
        assert torch.equal(tensor, after["model"][name]), f"weight {name} changed on a skipped step"
    for i, (a, b) in enumerate(zip(before["master"], after["master"])):
        assert torch.equal(a, b), f"master weight {i} changed on a skipped step"
    for index, state in after["optimizer"].items():
        for key, value in state.items():
            if index in before["optimizer"]:
                assert torch.equal(torch.as_tensor(before["optimizer"][index][key]), torch.as_tensor(value)), \
                    f"optimizer state {index}.{key} changed on a skipped step"
            else:  # state created during the skipped step must be the fresh state: all zeros
                assert not torch.as_tensor(value).any(), f"optimizer state {index}.{key} born non-zero"


def run_fault_case(case: int):
    rng = random.Random(case)
    recipe = rng.choice(RECIPES)
    opt_name = rng.choice(list(OPTIMIZERS))
    bad_step = rng.randrange(0, 4)
    value = rng.choice([math.inf, -math.inf, math.nan])
    model = tiny_model(seed=case)
    mp = MixedPrecision(model, OPTIMIZERS[opt_name](model.parameters()), recipe, seed=case,
                        clip_grad_norm=rng.choice([None, 1.0]))
    params = [p for p in model.parameters()]
    target = rng.choice(params)

    def plant():
        flat = target.grad.view(-1)
        flat[rng.randrange(flat.numel())] = value

    for step, (x, y) in enumerate(batches(bad_step + 2, seed=case)):
        if step == bad_step:
            before, scale_before = snapshot(mp), mp.scale
            result = train_step(mp, x, y, plant)
            assert result.skipped, f"case {case}: {recipe}/{opt_name} did not skip"
            assert_bitwise_unchanged(before, snapshot(mp))
            config = parse_recipe(recipe).loss_scale
            expected = scale_before
            if config.kind == "dynamic" and config.hysteresis == 1:
                expected = max(scale_before * config.backoff, config.floor)
            assert mp.scale == expected, f"case {case}: scale {mp.scale} != {expected}"
        else:
            assert not train_step(mp, x, y).skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert mp.skipped_steps == 1
    return recipe, opt_name


def test_fault_injection_200_cases_leave_everything_bitwise_unchanged():
    seen = {run_fault_case(case) for case in range(200)}
    assert len({r for r, _ in seen}) == len(RECIPES) and len({o for _, o in seen}) == len(OPTIMIZERS)


@pytest.mark.parametrize("case", [3, 7, 11])
def test_a_broken_engine_that_never_skips_fails_the_fault_check(case, monkeypatch):
    # Break the overflow detection: every norm looks finite, so inf/NaN reach the optimizer.
    monkeypatch.setattr(optimizer_step, "nonfinite", lambda norm: torch.zeros_like(norm, dtype=torch.bool))
    with pytest.raises(AssertionError):
        run_fault_case(case)


def test_fused_sgd_first_step_skip_does_not_leave_garbage_momentum():
    # torch's fused SGD fills momentum buffers with empty_like on its first step and leaves them
    # uninitialised when found_inf skips it; mixprec must end where a run without that step ends.
    data = batches(4)
    runs = []
    for skip_first in (True, False):
        model = tiny_model()
        mp = MixedPrecision(model, OPTIMIZERS["sgd-momentum-fused"](model.parameters()), "bf16")
        if skip_first:
            train_step(mp, *data[0], plant=lambda: model[0].weight.grad.fill_(math.inf))
        for x, y in data[1:]:
            train_step(mp, x, y)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adamw-fused"])
def test_fp16_with_static_scale_tracks_an_fp32_twin(opt_name):
    data = batches(30)
    final = {}
    for recipe in ("fp32", "params=fp32,compute=fp16,master=none,scale=static:1024", "fp16-pure"):
        model = tiny_model()
        mp = MixedPrecision(model, OPTIMIZERS[opt_name](model.parameters()), recipe)
        for x, y in data:
            assert not train_step(mp, x, y).skipped
        final[recipe] = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    ref = final.pop("fp32")
    for recipe, weights in final.items():
        rel = (weights - ref).norm() / ref.norm()
        assert rel < 5e-3, f"{recipe} drifted {rel:.2e} from fp32"
        assert rel > 0, f"{recipe} is bitwise fp32: the low precision was never applied"


@pytest.mark.parametrize("recipe", ["params=fp32,compute=fp16,master=none,scale=static:1024",
                                    "params=fp16,compute=fp16,master=fp32,scale=static:1024"])
@pytest.mark.parametrize("fused", [False, True])
def test_clipping_uses_the_unscaled_norm(recipe, fused):
    # loss = w . x with x = (3, 4): the gradient is x, its norm 5; clipped to 1 it is (0.6, 0.8).
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1.0, fused=fused), recipe,
                        clip_grad_norm=1.0)
    with mp.autocast():
        loss = model(torch.tensor([[3.0, 4.0]])).sum()
    mp.backward(loss)
    result = mp.step()
    assert result.grad_norm == 5.0 and not result.skipped
    w = (mp.master.masters[0] if mp.master else model.weight).detach().flatten()
    torch.testing.assert_close(w, torch.tensor([0.4, 0.2]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("recipe", ["fp32", "fp16", "fp16-pure"])
def test_gradient_accumulation_equals_the_full_batch(recipe):
    (x, y), = batches(1, batch=64)
    results = []
    for halves in (False, True):
        model = tiny_model()
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
        parts = [(x[:32], y[:32]), (x[32:], y[32:])] if halves else [(x, y)]
        for xs, ys in parts:
            with mp.autocast():
                loss = F.cross_entropy(model(xs), ys) / len(parts)
            mp.backward(loss)
        mp.step()
        results.append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
    tol = 1e-6 if recipe == "fp32" else 2e-3
    torch.testing.assert_close(results[1], results[0], atol=tol, rtol=0)


def build(recipe, opt_name, seed):
    model = tiny_model(seed)
    return MixedPrecision(model, OPTIMIZERS[opt_name](model.parameters()), recipe, seed=seed,
                          clip_grad_norm=1.0)


@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure", "bf16-sr",
                                    "params=fp32,compute=fp16,master=none,scale=dynamic(growth_interval=2,hysteresis=2)"])
@pytest.mark.parametrize("opt_name", ["adamw-fused", "sgd-momentum"])
def test_state_round_trip_through_pickle_continues_bit_for_bit(recipe, opt_name):
    data = batches(12)
    overflow_at = {2, 5, 6}
    for stop in (1, 4, 7):
        runs = []
        for interrupted in (False, True):
            mp = build(recipe, opt_name, seed=3)
            for step, (x, y) in enumerate(data):
                if interrupted and step == stop:
                    blob = pickle.dumps({"model": mp.model.state_dict(), "opt": mp.optimizer.state_dict(),
                                         "mp": mp.state_dict()})
                    mp = build(recipe, opt_name, seed=99)   # different init and SR seed: all must load
                    state = pickle.loads(blob)
                    mp.model.load_state_dict(state["model"])
                    mp.load_state_dict(state["mp"])
                    mp.optimizer.load_state_dict(state["opt"])
                plant = (lambda m=mp: next(m.model.parameters()).grad.fill_(math.inf)) \
                    if step in overflow_at else None
                train_step(mp, x, y, plant)
            runs.append((snapshot(mp), mp.scale, mp.skipped_steps))
        (a, scale_a, skipped_a), (b, scale_b, skipped_b) = runs
        assert (scale_a, skipped_a) == (scale_b, skipped_b)
        assert_bitwise_unchanged(a, b)


def test_master_copy_keeps_updates_that_fp16_weights_lose():
    # |w| / |update| = 1 / 1e-4 > 2048: w + update rounds back to w in fp16. The master keeps it.
    weights = {}
    for master in ("fp32", "none"):
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-4),
                            f"params=fp16,compute=fp16,master={master},scale=static:8")
        for _ in range(100):
            with mp.autocast():
                loss = model(torch.ones(1, 1)).sum()    # d loss / d w = 1
            mp.backward(loss)
            assert not mp.step().skipped
            mp.zero_grad()
        weights[master] = model.weight.item()
        if master == "fp32":
            exact = 1.0
            for _ in range(100):   # the same SGD updates in fp32 arithmetic
                exact = (torch.tensor(exact) - torch.tensor(1e-4)).item()
            assert mp.master.masters[0].item() == exact
            assert weights[master] == torch.tensor(exact).half().item()   # the model holds round(master)
    assert weights["none"] == 1.0 and weights["fp32"] < 0.9905


def test_lr_scheduler_steps_without_warnings_even_when_the_first_step_is_skipped():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    mp = MixedPrecision(model, opt, "fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, (x, y) in enumerate(batches(4)):
            train_step(mp, x, y, (lambda: model[0].weight.grad.fill_(math.nan)) if step == 0 else None)
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_step_result_reads_lazily_and_reports():
    model = tiny_model()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
    result = train_step(mp, *batches(1)[0])
    assert isinstance(result.skipped_t, torch.Tensor) and result.scale == 2.0**16
    assert "skipped=False" in repr(result) and math.isfinite(result.grad_norm)


class TestBadInput:
    def test_unknown_recipe(self, model):
        with pytest.raises(ValueError, match="named recipes: fp32, tf32"):
            MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp61")

    def test_optimizer_of_another_model(self, model):
        other = tiny_model(1)
        with pytest.raises(ValueError, match="not Sequential's: build it from this model"):
            MixedPrecision(model, torch.optim.SGD(other.parameters(), lr=0.1), "fp16")

    def test_model_without_parameters(self):
        with pytest.raises(ValueError, match="has no parameters"):
            MixedPrecision(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), "fp16")

    def test_integer_loss_and_non_scalar_loss(self, model):
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
        with pytest.raises(TypeError, match="must be floating point"):
            mp.backward(torch.tensor(3))
        with mp.autocast():
            out = model(torch.randn(2, 8))
        with pytest.raises(ValueError, match="single number"):
            mp.backward(out)
        with pytest.raises(ValueError, match="does not require grad"):
            mp.backward(out.sum().detach())
        with pytest.raises(TypeError, match="loss as a tensor"):
            mp.backward(1.0)

    def test_integer_inputs_reach_the_model_unchanged(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 10))
        mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp16-pure")
        tokens = torch.randint(0, 10, (4, 5))
        with mp.autocast():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        mp.backward(loss)
        assert not mp.step().skipped

    def test_recipe_the_device_cannot_run(self, model):
        with pytest.raises(ValueError, match="cannot run on cpu: tf32 needs an NVIDIA GPU"):
            MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "tf32")

    def test_step_before_backward_and_bad_clip(self, model):
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
        with pytest.raises(RuntimeError, match="call mp.backward"):
            mp.step()
        with pytest.raises(ValueError, match="clip_grad_norm must be a positive"):
            MixedPrecision(tiny_model(), torch.optim.SGD(model.parameters(), lr=0.1), "fp16",
                           clip_grad_norm=-1)

    def test_state_from_another_recipe(self, model):
        a = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
        other = tiny_model()
        b = MixedPrecision(other, torch.optim.SGD(other.parameters(), lr=0.1), "bf16")
        with pytest.raises(ValueError, match="saved under recipe"):
            b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("in_backward", [False, True])
def test_scale_loss_for_a_trainers_own_backward_equals_mp_backward(in_backward):
    # A trainer that runs backward itself (Lightning: loss * S; Hugging Face: the loss logged unscaled,
    # S applied in its backward) must give mp.backward's gradients bit for bit, and step() accepts them.
    (x, y), = batches(1)
    by_engine, by_trainer = (MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp16")
                             for m in (tiny_model(), tiny_model()))
    with by_engine.autocast():
        by_engine.backward(F.cross_entropy(by_engine.model(x), y))
    with by_trainer.autocast():
        loss = F.cross_entropy(by_trainer.model(x), y)
    scaled = by_trainer.scale_loss(loss, in_backward=in_backward)
    assert torch.equal(scaled, loss if in_backward else loss * 2.0**16)
    scaled.backward()
    for a, b in zip(by_engine.model.parameters(), by_trainer.model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert not by_trainer.step().skipped and not by_engine.step().skipped
    for a, b in zip(by_engine.model.parameters(), by_trainer.model.parameters()):
        assert torch.equal(a, b)


def test_autocast_is_one_context_reused_across_steps_and_nests_and_restores_exactly():
    # autocast() hands out one torch.autocast for every step (building one is the costly part);
    # entered already (nested, or inside the user's own autocast off), it builds another, and every
    # exit restores the state as it was, dtype and nesting included.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    mp = MixedPrecision(lin, torch.optim.SGD(lin.parameters(), lr=0.1), "bf16")
    x = torch.randn(4, 8)
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    first = mp.autocast()
    assert mp.autocast() is first                   # not entered: the same one
    with first:
        assert lin(x).dtype == torch.bfloat16
        inner = mp.autocast()
        assert inner is not first                   # entered: a fresh one
        with torch.autocast("cpu", enabled=False):
            assert lin(x).dtype == torch.float32
            again = mp.autocast()
            assert again is not first               # inside the user's autocast off: still a fresh one
            with again:
                assert lin(x).dtype == torch.bfloat16
            assert lin(x).dtype == torch.float32
        with inner:
            assert lin(x).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before
    with mp.autocast():                             # exited: reused again
        assert lin(x).dtype == torch.bfloat16
    assert mp.autocast() is first and not torch.is_autocast_enabled("cpu")

"""Bad inputs to the engine (issue 24): each is a clear error naming the mistake and the fix, raised before
anything changes, or it trains right."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.devices import supports
from mixprec.diagnostics.range_collector import RangeCollector
from mixprec.step.grad_norm import GradNorm, global_norm_f32


def _step(mp, model, x):
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.backward(loss)
    return mp.step()


# --------------------------------------------------------------- weights' dtype against the recipe
@pytest.mark.parametrize("recipe, dtype, fix", [("fp16", torch.float16, "fp16-pure"),
                                                ("bf16", torch.bfloat16, "bf16-pure"),
                                                ("fp32", torch.float16, "fp16-pure")])
def test_16_bit_model_under_an_autocast_recipe_is_refused(recipe, dtype, fix):
    model = nn.Sequential(nn.Linear(4, 4)).to(dtype)
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with pytest.raises(ValueError, match=rf"'0.weight' is {str(dtype)[6:]}.*model.float\(\).*'{fix}'"):
        MixedPrecision(model, opt, recipe)
    assert model[0].weight.dtype == dtype and torch.equal(model[0].weight, before)
    assert opt.param_groups[0]["params"][0] is model[0].weight     # the optimizer untouched


def test_float64_model_under_fp16_is_refused():
    model = nn.Sequential(nn.Linear(4, 4)).double()
    with pytest.raises(ValueError, match=r"'0.weight' is float64.*leaves float64 ops in float64.*model.float"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")


def test_pure_recipe_takes_weights_already_in_its_dtype_with_exact_masters():
    # An fp16 start (e.g. a 16-bit checkpoint): the fp32 master is the weights' exact upcast, and an
    # update far below fp16's resolution accumulates there rather than rounding away.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False)).half()
    w16 = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    mp = MixedPrecision(model, opt, "fp16-pure")
    master = opt.param_groups[0]["params"][0]
    assert master.dtype == torch.float32 and torch.equal(master, w16.float())
    _step(mp, model, torch.randn(8, 4))
    assert not torch.equal(master, w16.float())          # the small update is kept in fp32


def test_pure_recipe_refuses_a_16_bit_weight_it_keeps_fp32():
    # LayerNorm is in fp32_modules: its weight is stepped with no master, so fp16 there would lose updates.
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).half()
    with pytest.raises(ValueError, match=r"'1.weight' is float16.*keeps this weight in fp32.*model.float"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-pure")


def test_pure_recipe_refuses_the_other_16_bit_dtype():
    model = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'0.weight' is bfloat16.*casts the weights to fp16 itself"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-pure")


# --------------------------------------------------------------------- add_param_group after the engine
def test_param_group_added_after_a_pure_engine_is_refused_at_step():
    torch.manual_seed(0)
    model, extra = nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision(model, opt, "fp16-pure")
    opt.add_param_group({"params": [extra.half().weight]})
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.randn(2, 4)).float().sum()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match=r"did not see.*float16.*add_param_group.*before building"):
        mp.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_param_group_of_the_models_own_fp32_weights_is_accepted():
    # Under an autocast recipe the model's fp32 weights left out at first need nothing from the engine.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    mp = MixedPrecision(model, opt, "bf16")
    opt.add_param_group({"params": list(model[1].parameters())})
    before = model[1].weight.detach().clone()
    _step(mp, model, torch.randn(2, 4))
    assert not torch.equal(model[1].weight, before)


# ---------------------------------------------------------------------------- fp8 with nothing to swap
def test_fp8_recipe_with_no_eligible_linear_warns_why():
    model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.warns(UserWarning, match=r"swapped no layer to fp8.*not multiples of 16"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8=current(backend=emulate)")


def test_fp8_recipe_on_a_model_without_linears_warns():
    model = nn.Sequential(nn.Conv1d(2, 2, 1))
    with pytest.warns(UserWarning, match=r"has no nn.Linear"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8=current(backend=emulate)")


def test_fp8_recipe_with_a_swapped_layer_does_not_warn_so():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8=current(backend=emulate)")
    assert not any("swapped no layer" in str(w.message) for w in seen)


# ------------------------------------------------------------------------ arguments: clear TypeErrors
def _model_opt():
    model = nn.Sequential(nn.Linear(4, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_grad_norm="1.0"), r"clip_grad_norm must be a positive number.*str '1.0'"),
    (dict(clip_grad_norm=True), r"clip_grad_norm must be a positive number.*bool True"),
    (dict(recipe="fp8", fp8_filter=True), r"fp8_filter must be a function"),
    (dict(process_group="bogus"), r"process_group must be 'auto'.*None.*ProcessGroup.*'bogus'"),
    (dict(process_group=3), r"process_group must be 'auto'"),
])
def test_bad_constructor_arguments_are_type_errors(kwargs, match):
    model, opt = _model_opt()
    with pytest.raises(TypeError, match=match):
        MixedPrecision(model, opt, **kwargs)
    assert isinstance(model[0], nn.Linear) and model[0].weight.dtype == torch.float32


@pytest.mark.parametrize("recipe", ["bf16-sr", "fp16", "bf16,moments=bf16-sr"])
@pytest.mark.parametrize("seed", ["abc", 1.5, None, True])
def test_a_seed_that_is_not_an_int_is_refused_before_anything_changes(recipe, seed):
    # Under bf16-sr the optimizer's weights were already swapped for fp32 copies when the noise refused
    # the seed; under fp16 it was taken and unused; under moments=bf16-sr it was "can only concatenate str".
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters())
    held = list(opt.param_groups[0]["params"])
    with pytest.raises(ValueError, match=rf"seed must be an int \(the stochastic-rounding seed, e.g. seed=0\), "
                                         rf"got {seed!r}"):
        MixedPrecision(model, opt, recipe, seed=seed)
    assert all(a is b for a, b in zip(held, opt.param_groups[0]["params"]))
    assert model[0].weight.dtype == torch.float32


def test_scale_loss_takes_a_floating_loss_tensor():
    model, opt = _model_opt()
    mp = MixedPrecision(model, opt, "fp16")
    with pytest.raises(TypeError, match=r"scale_loss\(\) needs the loss as a tensor, got str"):
        mp.scale_loss("loss")                    # was 'str' object has no attribute 'dtype'
    with pytest.raises(TypeError, match="the loss has dtype torch.int64; it must be floating point"):
        mp.scale_loss(torch.tensor(3))           # was tensor(196608), an int64 "loss"
    with mp.autocast():                          # the forward, as a trainer runs it
        loss = torch.tensor(2.0)
    assert mp.scale_loss(loss).item() == 2.0 * 2**16


def test_process_group_auto_and_none_still_accepted():
    for group in ("auto", None):
        model, opt = _model_opt()
        MixedPrecision(model, opt, "bf16", process_group=group)


def test_fp8_filter_checked_by_swap_too():
    from mixprec.fp8.swap import swap_to_fp8
    from mixprec.recipe import Fp8Config
    with pytest.raises(TypeError, match=r"fp8_filter must be a function"):
        swap_to_fp8(nn.Sequential(nn.Linear(16, 16)), Fp8Config(), backend="emulate", filter="lm_head")


def test_step_observer_without_its_methods_is_refused():
    model, opt = _model_opt()
    mp = MixedPrecision(model, opt, "fp16")
    with pytest.raises(TypeError, match=r"before_step\(engine\).*object has no before_step or after_step"):
        mp.add_step_observer(object())
    assert not mp._step_observers


def test_supports_takes_strings_and_says_what_it_takes():
    assert supports("fp16", "cpu").ok
    assert not supports("tf32", "cpu").ok
    with pytest.raises(TypeError, match=r"a Recipe or a recipe name"):
        supports(None, "cpu")
    with pytest.raises(TypeError, match=r"a torch.device or a device string"):
        supports("fp16", 0)
    with pytest.raises(ValueError, match=r"'bogus' is not a device"):
        supports("fp16", "bogus")
    with pytest.raises(ValueError, match=r"unknown recipe"):
        supports("fp17", "cpu")


def test_range_collector_on_a_bare_model_says_to_pass_the_engine():
    model, _ = _model_opt()
    with pytest.raises(TypeError, match=r"watches a MixedPrecision engine, got the model itself \(Sequential\)"):
        RangeCollector(model)


# -------------------------------------------------------------------------------- sparse gradients
def test_global_norm_of_sparse_gradients_is_that_of_the_dense_ones():
    dense = torch.zeros(10, 3)
    dense[[1, 4]] = torch.tensor([[3.0, 0.0, 4.0], [0.0, 12.0, 0.0]])
    # Index 4 twice: coalescing sums the duplicates, as the dense gradient holds them.
    sparse = torch.sparse_coo_tensor([[1, 4, 4]], torch.tensor([[3.0, 0.0, 4.0], [0.0, 5.0, 0.0],
                                                                [0.0, 7.0, 0.0]]), (10, 3))
    other = torch.full((2,), 2.0)
    want = global_norm_f32([dense, other])
    assert torch.equal(global_norm_f32([sparse, other]), want)
    assert torch.equal(GradNorm()([sparse.half(), other]), GradNorm()([dense.half(), other]))


def _embedding_run(recipe, sparse, clip=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision(model, opt, recipe, clip_grad_norm=clip)
    norms = []
    for _ in range(3):
        norms.append(float(_step(mp, model, torch.tensor([1, 2, 2, 5])).grad_norm))
        mp.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("recipe", ["fp32", "fp16", "bf16", "fp16-pure", "bf16-sr"])
def test_sparse_embedding_trains_as_the_dense_one(recipe):
    sparse_w, sparse_norms = _embedding_run(recipe, True, clip=0.01)
    dense_w, dense_norms = _embedding_run(recipe, False, clip=0.01)
    assert sparse_norms == dense_norms      # the same norm, so the same clip and skip decisions
    for s, d in zip(sparse_w, dense_w):     # SGD's sparse add rounds in another order than its dense one
        torch.testing.assert_close(s, d, rtol=0, atol=1e-6 if recipe in ("fp32", "fp16", "bf16") else 0)


def test_sparse_embedding_under_fp32_equals_torch_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.tensor([1, 2, 2, 5])).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    engine_w, _ = _embedding_run("fp32", True)
    assert all(torch.equal(a, b) for a, b in zip(engine_w, model.parameters()))


# --------------------------------------------------------------------------------- misleading messages
def test_all_parameters_frozen_says_so():
    model, opt = _model_opt()
    mp = MixedPrecision(model, opt, "bf16")
    model.requires_grad_(False)
    with mp.autocast():
        loss = model(torch.randn(2, 4)).float().sum()
    with pytest.raises(ValueError, match=r"every parameter of Sequential has requires_grad=False"):
        mp.backward(loss)
    with pytest.raises(RuntimeError, match=r"requires_grad=False"):
        mp.step()


def test_second_engine_on_the_same_pure_model_and_optimizer_says_so():
    model, opt = _model_opt()
    MixedPrecision(model, opt, "fp16-pure")
    with pytest.raises(ValueError, match=r"already belongs to a MixedPrecision engine.*'fp16-pure'.*"
                                         r"master copies"):
        MixedPrecision(model, opt, "fp16-pure")


def test_foreign_optimizer_still_says_it_holds_another_models_parameters():
    model, _ = _model_opt()
    other = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"not Sequential's: build it from this model"):
        MixedPrecision(model, torch.optim.SGD(other.parameters(), lr=0.1), "fp16")


def test_backward_on_another_models_loss_says_so():
    model, opt = _model_opt()
    other = nn.Linear(4, 1)
    mp = MixedPrecision(model, opt, "fp16")
    with mp.autocast():
        loss = other(torch.randn(2, 4)).float().sum()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match=r"mp.backward\(loss\) was called: was the loss computed from "
                                           r"another model's output"):
        mp.step()


def test_step_without_backward_keeps_its_message():
    model, opt = _model_opt()
    mp = MixedPrecision(model, opt, "fp16")
    with pytest.raises(RuntimeError, match=r"call mp.backward\(loss\) before mp.step\(\)"):
        mp.step()


def test_an_engine_and_its_model_are_freed_when_the_user_drops_them():
    # The registry that words the second-engine message holds engines weakly: a strong value would keep
    # its own model key alive, and every engine ever built with it.
    import gc
    import weakref
    refs = []
    for _ in range(3):
        model = torch.nn.Linear(4, 4)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure")
        refs += [weakref.ref(model), weakref.ref(mp)]
        del model, mp
    gc.collect()
    assert all(r() is None for r in refs)

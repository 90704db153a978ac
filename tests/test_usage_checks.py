"""Training-loop mistakes that used to train on silently wrong are refused or warned about, once."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from mixprec import MixedPrecision
from mixprec.guards.usage import SKIP_WARNING_AFTER

from conftest import OPTIMIZERS, batches, tiny_model


def engine(recipe="fp16", opt="adamw-foreach", **kwargs):
    model = tiny_model()
    return MixedPrecision(model, OPTIMIZERS[opt](model.parameters()), recipe, **kwargs)


def forward(mp, x, y, autocast=True):
    if autocast:
        with mp.autocast():
            return F.cross_entropy(mp.model(x), y)
    return F.cross_entropy(mp.model(x), y)


def weights(mp):
    return [p.detach().clone() for p in mp.model.parameters()]


@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure"])
def test_loss_backward_under_a_loss_scale_is_refused_before_anything_changes(recipe):
    mp = engine(recipe)
    x, y = batches(1)[0]
    forward(mp, x, y).backward()              # the mistake: no loss scale applied
    before, scale = weights(mp), mp.scale
    with pytest.raises(RuntimeError, match=r"did not come from mp.backward\(loss\).*S times too small"):
        mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(mp))) and mp.scale == scale
    assert mp.steps == 0


@pytest.mark.parametrize("opt", ["adamw-foreach", "adamw-fused", "sgd-momentum"])
@pytest.mark.parametrize("recipe", ["fp16", "bf16", "bf16-pure", "fp32"])
def test_a_second_step_without_a_new_backward_is_refused(recipe, opt):
    mp = engine(recipe, opt)
    x, y = batches(1)[0]
    mp.backward(forward(mp, x, y))
    mp.step()
    before = weights(mp)
    with pytest.raises(RuntimeError, match="without a new backward: these gradients were already applied"):
        mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(mp))) and mp.steps == 1


def test_loss_backward_without_a_loss_scale_is_fine_and_equals_mp_backward():
    # Under bf16 (S = 1) loss.backward() is exactly mp.backward(): both runs end bit for bit alike.
    runs = []
    for via_engine in (True, False):
        mp = engine("bf16")
        for x, y in batches(3):
            loss = forward(mp, x, y)
            mp.backward(loss) if via_engine else loss.backward()
            mp.step()
            mp.zero_grad(set_to_none=False)    # the same grad tensors are reused: versions decide
        runs.append(weights(mp))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_gradient_accumulation_and_the_normal_loop_do_not_warn():
    mp = engine("fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(batches(6)):
            mp.backward(forward(mp, x, y))
            if i % 2 == 1:
                mp.step()
                mp.zero_grad()


@pytest.mark.parametrize("recipe", ["fp16", "bf16", "fp16-pure"])
def test_forgetting_autocast_warns_once(recipe):
    mp = engine(recipe)
    said = "ran without autocast's op lists" if "pure" in recipe else "ran in fp32"
    with pytest.warns(UserWarning, match=r"mp.autocast\(\) was not entered.*" + said) as record:
        for x, y in batches(3):
            mp.backward(forward(mp, x, y, autocast=False))
            mp.step()
            mp.zero_grad()
    assert sum("mp.autocast()" in str(w.message) for w in record) == 1


def test_fp32_without_autocast_does_not_warn():
    mp = engine("fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = batches(1)[0]
        mp.backward(forward(mp, x, y, autocast=False))
        mp.step()


def nan_loss_run(mp, steps):
    x, y = batches(1)[0]
    results = []
    for _ in range(steps):
        loss = forward(mp, x, y) * float("nan")
        mp.backward(loss)
        results.append(mp.step().skipped)
        mp.zero_grad()
    return results


@pytest.mark.parametrize("recipe, opt", [("bf16", "adamw-foreach"), ("fp32", "adamw-fused"),
                                         ("params=fp32,compute=fp16,scale=static:1024", "sgd-momentum"),
                                         ("bf16-pure", "adamw-fused")])
def test_every_step_skipped_warns_once_after_n_in_a_row(recipe, opt):
    mp = engine(recipe, opt)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        skipped = nan_loss_run(mp, SKIP_WARNING_AFTER - 1)
        assert all(skipped) and not [w for w in record if "in a row" in str(w.message)]
        nan_loss_run(mp, 5)
    hits = [w for w in record if "in a row were skipped" in str(w.message)]
    assert len(hits) == 1 and issubclass(hits[0].category, RuntimeWarning)
    assert f"{SKIP_WARNING_AFTER} steps in a row" in str(hits[0].message)
    assert "trace_nonfinite=True" in str(hits[0].message)


def test_a_clean_step_resets_the_count():
    mp = engine("bf16", "adamw-fused")
    x, y = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            nan_loss_run(mp, SKIP_WARNING_AFTER - 1)
            mp.backward(forward(mp, x, y))
            assert not mp.step().skipped
            mp.zero_grad()


def test_the_skip_warning_points_at_last_overflow_when_tracing():
    mp = engine("bf16", trace_nonfinite=True)
    with pytest.warns(RuntimeWarning, match="mp.last_overflow names the module and op"):
        nan_loss_run(mp, SKIP_WARNING_AFTER)


# ------------------------------------------------------------------ optimizer.step() instead of mp.step()
def _opt_state(opt):
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]


@pytest.mark.parametrize("opt", ["sgd-momentum", "sgd-momentum-fused", "adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure", "bf16-pure"])
def test_a_bare_optimizer_step_is_refused_where_only_mp_step_steps_right(recipe, opt):
    # fp16: the gradients carry S = 65536 (SGD would move the weights 65536x too far); the pure
    # recipes: the optimizer holds fp32 copies that only mp.step() fills and rounds back.
    mp = engine(recipe, opt)
    batch = batches(2)
    mp.backward(forward(mp, *batch[0]))
    mp.step()                                  # mp.step()'s own optimizer.step() goes through
    mp.zero_grad()
    mp.backward(forward(mp, *batch[1]))
    before, state, scale = weights(mp), _opt_state(mp.optimizer), mp.scale
    reason = "loss scale S" if recipe == "fp16" else "fp32 copies"
    with pytest.raises(RuntimeError, match=rf"step\(\) was called directly, but .*{reason}.*Call mp.step\(\)"):
        mp.optimizer.step()
    # Refused before anything moved: weights, optimizer state and the loss scale as they were.
    assert all(torch.equal(a, b) for a, b in zip(before, weights(mp)))
    for a, b in zip(state, _opt_state(mp.optimizer)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                            for k in a)
    assert mp.scale == scale and mp.steps == 1
    mp.step()                                  # and the engine's step still runs after the refusal
    assert mp.steps == 2 and not all(torch.equal(a, b) for a, b in zip(before, weights(mp)))


@pytest.mark.parametrize("opt", ["sgd-momentum", "adamw-fused"])
def test_a_bare_optimizer_step_is_left_alone_where_it_is_correct(opt):
    # bf16 (S = 1, fp32 weights): optimizer.step() after loss.backward() is torch's own bf16 loop, so
    # no guard is installed at all, and it equals mp.step() bit for bit.
    runs = []
    for bare in (False, True):
        mp = engine("bf16", opt)
        x, y = batches(1)[0]
        assert not mp.optimizer._optimizer_step_pre_hooks
        loss = forward(mp, x, y)
        if bare:
            loss.backward()
            mp.optimizer.step()
        else:
            mp.backward(loss)
            mp.step()
        runs.append(weights(mp))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_bare_step_after_loss_backward_under_fp16_is_the_users_own_loop():
    # Only mp.autocast() used (benchmarks/host/bench_oplists.py): loss.backward() leaves unscaled gradients,
    # and optimizer.step() on them is plain torch.autocast: not refused, and equal to a loop without mixprec.
    runs = []
    for use_engine in (True, False):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mp = MixedPrecision(model, opt, "fp16") if use_engine else None
        for x, y in batches(2):
            with torch.autocast("cpu", dtype=torch.float16):
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
        if mp is not None:      # and once mp.backward() scaled them, the bare step is refused
            mp.backward(forward(mp, *batches(1)[0]))
            with pytest.raises(RuntimeError, match="multiplied these gradients by the loss scale S"):
                opt.step()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_later_engine_on_the_same_optimizer_replaces_the_guard():
    # The first engine's flag is never set again: its guard must not refuse the second engine's steps.
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    MixedPrecision(model, opt, "fp16")
    mp = MixedPrecision(model, opt, "fp16")
    assert len(opt._optimizer_step_pre_hooks) == 1
    mp.backward(forward(mp, *batches(1)[0]))
    assert not mp.step().skipped
    MixedPrecision(model, opt, "bf16")              # bf16 needs no guard: the old one is removed too
    assert not opt._optimizer_step_pre_hooks


def test_a_bare_step_with_compact_moments_is_refused():
    mp = engine("bf16,moments=bf16", "adamw-foreach")
    mp.backward(forward(mp, *batches(1)[0]))
    with pytest.raises(RuntimeError, match="compact in the engine's own AdamW"):
        mp.optimizer.step()
    mp.step()


# ---------------------------------------------------------------- the model cast after the engine was built
@pytest.mark.parametrize("recipe, cast", [("fp16", "half"), ("bf16", "bfloat16"), ("fp16-pure", "float")])
def test_casting_the_model_after_building_the_engine_is_refused_at_step(recipe, cast):
    # model.half() under fp16 left fp32-recipe weights in fp16 with no master copy: no error, no word.
    # A cast before the forward is refused on entering mp.autocast() (the next test); one between
    # backward and step, here.
    mp = engine(recipe)
    x, y = batches(1)[0]
    mp.backward(forward(mp, x, y))
    getattr(mp.model, cast)()
    before = weights(mp)
    with pytest.raises(RuntimeError, match=r"changed dtype after MixedPrecision was built \('0.weight' was "
                                           r"\w+, now \w+\): was model.half\(\)"):
        mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(mp))) and mp.steps == 0


def test_casting_a_pure_model_is_refused_on_entering_autocast_before_the_forward_fails():
    # bf16-pure keeps LayerNorm fp32: after model.half() the forward failed inside torch ("mixed dtype
    # (CPU): expect parameter to have scalar type of Float") before step() could say why.
    mp = engine("bf16-pure")
    mp.model.half()
    tf32 = torch.backends.cuda.matmul.fp32_precision
    with pytest.raises(RuntimeError, match=r"changed dtype after MixedPrecision was built \('0.weight' was "
                                           r"bfloat16, now float16\): was model.half\(\)"):
        with mp.autocast():
            raise AssertionError("the forward must not run")
    assert torch.backends.cuda.matmul.fp32_precision == tf32 and not mp._checks.entered_autocast


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure", "bf16-sr", "bf16-kahan"])
@pytest.mark.parametrize("cast", ["half", "bfloat16"])
def test_a_cast_that_leaves_the_first_weight_alone_is_refused_by_what_the_recipe_kept_fp32(recipe, cast):
    # Issue 33: the guard looked at the first parameter only, already 16-bit under these recipes, so
    # model.half() / model.bfloat16() ended in torch's "mixed dtype" error inside LayerNorm.
    mp = engine(recipe)
    low = mp.model[0].weight.dtype
    getattr(mp.model, cast)()
    if mp.model[0].weight.dtype != low:
        return          # the first weight changed too: the test above covers that
    with pytest.raises(RuntimeError, match=r"changed dtype after MixedPrecision was built \('1.weight' was "
                                           r"float32, now \w+\): was model.half\(\)"):
        with mp.autocast():
            raise AssertionError("the forward must not run")


def test_trace_nonfinite_takes_a_bool_only():
    with pytest.raises(TypeError, match="trace_nonfinite must be True or False, got 'no'"):
        engine("fp16", trace_nonfinite="no")


def test_the_autocast_warning_names_a_torch_autocast_of_the_users_own():
    # Under torch.autocast(float16) the Linear ran in fp16: the warning said "the forward ran in fp32".
    mp = engine("fp16")
    x, y = batches(1)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        assert mp.model[0](x).dtype == torch.float16       # the Linear ran in fp16
        loss = F.cross_entropy(mp.model(x), y)
        with pytest.warns(UserWarning, match="a torch.autocast of your own is on here, so the forward ran in "
                                             "its dtype and op lists, not the recipe's") as record:
            mp.backward(loss)
    assert "ran in fp32" not in str(record[0].message)



def test_the_device_decided_skip_run_is_read_from_an_earlier_steps_copy_without_waiting():
    # The CUDA path (the step decided on the device): after_step counts skips in a device tensor and
    # reads the copy an earlier step left in pinned memory. Emulated with CPU tensors, where the copy
    # lands at once: each read returns the count as of the step before.
    from mixprec.recipe import get_recipe
    from mixprec.guards.usage import UsageChecks
    checks = UsageChecks(get_recipe("bf16"), False, torch.device("cpu"))
    assert checks._read_run_if_free() is None            # a CPU engine: the host knows each outcome
    checks._on_cuda = True                              # the CUDA branch, its pinned buffer a plain one
    checks._host = torch.zeros((), dtype=torch.int64)
    reads = []
    for skipped in [1, 1, 0, 1, 1, 1]:
        checks.skip_run.add_(1).mul_(torch.tensor(skipped))     # as after_step does on the device
        reads.append(checks._read_run_if_free())
    assert reads == [0, 1, 2, 0, 1, 2] and int(checks._host) == 3

"""Fused small functions (mixprec.fusion): compiled, they give the eager numbers; where compiling fails
they warn once and run eagerly. The loss-scale update is the one every fp16 step runs."""

import warnings

import torch

from mixprec.fusion import FusedFunction, FusionWarning
from mixprec.loss_scale.scales import DynamicLossScale
from mixprec.recipe import LossScaleConfig


def test_fused_loss_scale_update_walks_exactly_as_the_eager_one():
    # Hysteresis 2, growth every 2 clean steps, a floor and a ceiling that both bind on this walk.
    config = LossScaleConfig(init=2.0**3, growth_interval=2, hysteresis=2, floor=1.0, ceiling=2.0**4)
    eager, fused = DynamicLossScale(config), DynamicLossScale(config)
    assert not eager.fused                      # CPU default
    fused.fused = True
    walk = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    values = []
    for overflow in walk:
        for ls in (eager, fused):
            ls.update(torch.tensor(bool(overflow)))
        assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), fused.state_dict().values()))
        values.append(float(fused.value))
    # By hand: 8 -> 16 (grow) -> ceiling holds 16; two overflows spend the hysteresis budget, then
    # every overflow halves down to the floor 1, which holds (the overflow seen *at* the floor is
    # counted); two clean steps grow to 2 and refill the budget, so the next overflow only spends it.
    assert values[:4] == [8.0, 16.0, 16.0, 16.0]
    assert values[4:10] == [16.0, 8.0, 4.0, 2.0, 1.0, 1.0]
    assert values[10:13] == [1.0, 2.0, 2.0]
    assert int(fused.floor_skips) == 1 and int(fused.skipped) == 7


def test_the_default_hysteresis_updates_through_torchs_op_on_every_device_as_the_general_update_would():
    # hysteresis 1 on CUDA takes torch's _amp_update_scale_ (fewer host calls than the compiled
    # general update): the general one, compiled, walks the same states bit for bit, but for the
    # hysteresis budget it spends and refills, which a budget of one overflow never reads.
    config = LossScaleConfig(init=2.0**3, growth_interval=2, floor=1.0, ceiling=2.0**4)
    assert not DynamicLossScale(config, "cuda" if torch.cuda.is_available() else "cpu").fused
    plain, general = DynamicLossScale(config), DynamicLossScale(config)
    general.fused = True
    values = []
    for overflow in [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1]:
        for ls in (plain, general):
            ls.update(torch.tensor(bool(overflow)))
        a, b = plain.state_dict(), general.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "hysteresis_left")
        values.append(float(plain.value))
    # By hand: 8 -> 16 (grow), held at the ceiling; each overflow halves down to the floor 1; two clean
    # steps grow to 2; the next overflow halves to 1, and the one after is seen at the floor (counted).
    assert values == [8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 1.0, 1.0, 2.0, 1.0, 1.0]
    assert int(plain.floor_skips) == 1 and int(plain.skipped) == 6


def test_a_function_that_cannot_compile_warns_once_and_runs_eagerly():
    fn = FusedFunction(lambda x: x * 3, "triple")

    def broken(*args):
        raise RuntimeError("Triton not found")
    fn._compiled = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [fn(torch.ones(2)) for _ in range(3)]
    assert all(torch.equal(o, torch.full((2,), 3.0)) for o in out)
    notes = [w for w in caught if issubclass(w.category, FusionWarning)]
    assert len(notes) == 1 and "triple" in str(notes[0].message) and "Triton not found" in str(notes[0].message)
    assert fn.broken == "RuntimeError: Triton not found"


def test_fused_false_never_compiles():
    fn = FusedFunction(lambda x: x + 1, "inc")
    assert torch.equal(fn(torch.zeros(1), fused=False), torch.ones(1)) and fn._compiled is None

"""Loss scales walked step by step by hand, against a reference model of the spec, and round-tripped."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import LossScaleConfig
from mixprec.loss_scale.scales import DynamicLossScale, NoLossScale, StaticLossScale

T, F = torch.tensor(True), torch.tensor(False)


def walk(scale, overflows):
    values = []
    for overflow in overflows:
        scale.update(T if overflow else F)
        values.append(float(scale.value))
    return values


def test_dynamic_scale_by_hand_growth_interval_2_hysteresis_2():
    ls = DynamicLossScale(LossScaleConfig(growth_interval=2, hysteresis=2))
    #            step:  1      2     3      4       5      6      7      8      9     10
    overflows = [False, True, False, False, True, True, True, False, False, True]
    # 2: first overflow spends the hysteresis budget (2 -> 1), no back-off.
    # 4: two clean steps in a row -> x2, budget refilled to 2.
    # 5: budget 2 -> 1, no back-off. 6: budget 1 -> 0, x0.5. 7: budget still 0, x0.5 again.
    # 9: two clean steps -> x2, refill. 10: budget 2 -> 1, no back-off.
    expected = [2**16, 2**16, 2**16, 2**17, 2**17, 2**16, 2**15, 2**15, 2**16, 2**16]
    assert walk(ls, overflows) == expected
    assert int(ls.skipped) == 5 and int(ls.steps) == 10


def test_default_dynamic_scale_backs_off_every_overflow_and_grows_after_2000():
    ls = DynamicLossScale()
    assert walk(ls, [True]) == [2**15]
    assert walk(ls, [False] * 1999) [-1] == 2**15
    assert walk(ls, [False]) == [2**16]


def test_floor_is_held_counted_and_warned_about_once():
    ls = DynamicLossScale(LossScaleConfig(init=4.0, floor=1.0))
    assert walk(ls, [True] * 5) == [2, 1, 1, 1, 1]
    assert int(ls.floor_skips) == 3 and int(ls.skipped) == 5
    with pytest.warns(RuntimeWarning, match="floor"):
        ls.warn_if_at_floor()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ls.warn_if_at_floor()        # only once


def test_ceiling_caps_growth_and_nan_inf_never_reach_the_scale():
    ls = DynamicLossScale(LossScaleConfig(init=2.0**24, growth_interval=1))
    assert walk(ls, [False] * 3) == [2**24] * 3
    ls = DynamicLossScale(LossScaleConfig(init=1.0, floor=2.0**-10))
    values = walk(ls, [True] * 50)
    assert values[-1] == 2.0**-10 and all(v > 0 for v in values)


def reference(config, overflows):
    """The spec in plain Python, for comparison with the device-tensor implementation."""
    scale, clean, budget, out = config.init, 0, config.hysteresis, []
    for overflow in overflows:
        if overflow:
            clean = 0
            budget = max(budget - 1, 0)
            if budget == 0:
                scale = max(scale * config.backoff, config.floor)
        else:
            clean += 1
            if clean >= config.growth_interval:
                scale, clean, budget = min(scale * config.growth, config.ceiling), 0, config.hysteresis
        out.append(scale)
    return out


@settings(max_examples=60, deadline=None)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=40),
       interval=st.integers(1, 4), hysteresis=st.integers(1, 3))
def test_dynamic_scale_matches_the_reference(overflows, interval, hysteresis):
    config = LossScaleConfig(init=2.0**8, growth_interval=interval, hysteresis=hysteresis,
                             floor=2.0**4, ceiling=2.0**12)
    assert walk(DynamicLossScale(config), overflows) == reference(config, overflows)


def test_static_and_none_never_change_but_count():
    s = StaticLossScale(1024.0)
    assert walk(s, [True, False, True]) == [1024.0] * 3 and int(s.skipped) == 2
    n = NoLossScale()
    assert walk(n, [False, True]) == [1.0, 1.0] and int(n.skipped) == 1
    loss = torch.tensor(3.0)
    assert n.scale(loss) is loss and float(s.scale(loss)) == 3072.0


@pytest.mark.parametrize("make", [NoLossScale, lambda: StaticLossScale(8.0), DynamicLossScale])
def test_counts_the_host_knows_cost_no_op_and_read_as_the_device_counts(make):
    # Where the host already knows the outcome (a CPU step, the generic path) the step and skip counts
    # are kept in Python and folded into the same tensors when read: the same numbers as counting on
    # the device, mixed in any order, through a state round trip.
    host, device = make(), make()
    outcomes = [False, True, False, False, True, False]
    for i, skip in enumerate(outcomes):
        flag = T if skip else F
        device.update(flag)
        if i % 3 == 2:
            host.update(flag)               # a compiled step: counted on the device
        else:
            host.update(flag, skip)
    steps, skipped = host.steps, host.skipped
    assert (int(steps), int(skipped)) == (int(device.steps), int(device.skipped)) == (6, 2)
    assert host.steps is steps and host.skipped is skipped      # the same tensors, read again
    assert all(torch.equal(a, b) for a, b in zip(host.state_dict().values(), device.state_dict().values()))
    if isinstance(host, (NoLossScale, StaticLossScale)):
        version = steps._version
        host.update(F, False)               # a clean step known on the host: no tensor touched
        assert steps._version == version and int(host.steps) == 7
    fresh = make()
    fresh.update(T, True)                   # a host count pending when the state is loaded: dropped
    fresh.load_state_dict(device.state_dict())
    assert (int(fresh.steps), int(fresh.skipped)) == (6, 2)


def test_state_round_trip_continues_identically():
    config = LossScaleConfig(growth_interval=3, hysteresis=2)
    a = DynamicLossScale(config)
    walk(a, [False, True, False, False])
    b = DynamicLossScale(config)
    b.load_state_dict(a.state_dict())
    tail = [True, False, False, False, True, True]
    assert walk(a, tail) == walk(b, tail)


def test_loading_another_kind_of_state_is_a_clear_error():
    with pytest.raises(ValueError, match="different kind of loss scale"):
        DynamicLossScale().load_state_dict(StaticLossScale(2.0).state_dict())


# ------------------------------------------------------------------ issue 24: values checked where they enter
@pytest.mark.parametrize("kwargs, error, words", [
    (dict(init="1024"), TypeError, ["LossScaleConfig.init must be a number", "'1024'"]),
    (dict(floor=None), TypeError, ["LossScaleConfig.floor must be a number"]),
    (dict(init=True), TypeError, ["LossScaleConfig.init must be a number"]),
    (dict(growth_interval=2.5), TypeError, ["LossScaleConfig.growth_interval must be an int", "2.5"]),
    (dict(growth_interval=2.0), TypeError, ["must be an int", "write growth_interval=2"]),
    (dict(hysteresis=True), TypeError, ["LossScaleConfig.hysteresis must be an int", "True"]),
    (dict(hysteresis="2"), TypeError, ["LossScaleConfig.hysteresis must be an int"]),
    (dict(hysteresis=3_000_000_000), ValueError, ["hysteresis", "2**31-1 = 2147483647", "int32"]),
    (dict(growth_interval=2**31), ValueError, ["growth_interval", "2147483647"]),
    (dict(init=1e-50, floor=1e-50), ValueError, ["init=1e-50 is below 2**-24"]),
    (dict(kind="static", init=1e-30), ValueError, ["init=1e-30 is below 2**-24", "flushes to zero"]),
    (dict(ceiling=1e39), ValueError, ["ceiling=1e+39 is inf in fp32"]),
    (dict(ceiling=10**400), ValueError, ["is inf in fp32"]),
    (dict(backoff=1e-50), ValueError, ["backoff must be in (0, 1)"]),
])
def test_config_refuses_wrong_types_and_values_naming_the_field(kwargs, error, words):
    with pytest.raises(error) as e:
        LossScaleConfig(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_smallest_scale_keeps_a_unit_gradient_in_fp16():
    # The bound, by hand: S = 2**-24 turns a gradient of 1 into fp16's smallest subnormal (2**-24); S =
    # 2**-25 turns it into exactly half of that, which rounds (ties to even) to 0.
    assert float(torch.tensor(1.0 * 2.0**-24).half()) == 2.0**-24
    assert float(torch.tensor(1.0 * 2.0**-25).half()) == 0.0
    s = StaticLossScale(2.0**-24)
    assert float(s.value) == 2.0**-24 and s.value.dtype == torch.float32
    with pytest.raises(ValueError, match="below 2"):
        StaticLossScale(2.0**-25)
    with pytest.raises(ValueError, match=r"in fp32, the scale's device dtype: 0\)"):
        StaticLossScale(1e-50)        # fp32 holds 1e-50 as 0: every weight would become NaN
    with pytest.raises(TypeError, match="must be a number"):
        StaticLossScale("1024")


def test_counts_at_the_int32_limit_build_their_state():
    ls = DynamicLossScale(LossScaleConfig(growth_interval=2**31 - 1, hysteresis=2**31 - 1))
    assert int(ls.hysteresis_left) == 2**31 - 1
    assert walk(ls, [True, False]) == [2**16, 2**16]


def test_dynamic_scale_takes_a_config():
    with pytest.raises(TypeError, match="takes a LossScaleConfig"):
        DynamicLossScale("dynamic")

"""The fp8 capability and speed probes: never decided inside a fake-tensor trace (memory_report,
inspect); on a CPU, ``backend=auto`` takes the faster of torch._scaled_mm and the emulation."""

import time
import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec import Fp8EmulationWarning, MixedPrecision, memory_report
from mixprec.devices import _probe, _time_fp8, probe_fp8_speed, probe_scaled_mm


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def _fresh_probe():
    _probe.cache_clear()
    support = probe_scaled_mm("cpu")
    _probe.cache_clear()
    return support


@pytest.fixture
def fresh_probes():
    _probe.cache_clear()
    _time_fp8.cache_clear()
    yield
    _probe.cache_clear()
    _time_fp8.cache_clear()


def test_memory_report_first_then_an_engine_gets_the_real_verdict():
    truth = _fresh_probe()                    # what this machine can do, probed outside any trace
    try:
        report = memory_report(_mlp(), "fp8", torch.randn(32, 64), measure=True)   # traces first
        assert probe_scaled_mm("cpu") == truth                                    # not poisoned
        model = _mlp()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
        emulated = [w for w in caught if issubclass(w.category, Fp8EmulationWarning)]
        fast = truth.ok and probe_fp8_speed("cpu").ratio <= 2      # what auto picks on this CPU
        assert mp.fp8_report.backend == ("scaled_mm" if fast else "emulate")
        assert bool(emulated) == (not fast)
        # The prediction traced the backend a real run uses: fp8 activations as measured.
        assert report.predicted.activations == report.measured.activations
    finally:
        _probe.cache_clear()


def test_a_probe_asked_inside_fake_mode_is_the_real_one():
    truth = _fresh_probe()
    try:
        with FakeTensorMode():
            inside = probe_scaled_mm("cpu")
        assert inside == truth and probe_scaled_mm("cpu") == truth
    finally:
        _probe.cache_clear()


needs_scaled_mm = pytest.mark.skipif(not _fresh_probe().ok, reason="torch._scaled_mm does not run on this CPU")


def _slow_scaled_mm(monkeypatch, delay_s):
    """torch._scaled_mm made ``delay_s`` slower per call, as torch's reference loop is on some CPUs."""
    real, calls = torch._scaled_mm, []

    def slow(*args, **kwargs):
        calls.append(args[0].shape)
        time.sleep(delay_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", slow)
    return calls


def _engine(recipe="fp8"):
    model = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    return mp, [w for w in caught if issubclass(w.category, Fp8EmulationWarning)]


@needs_scaled_mm
def test_a_slow_scaled_mm_kernel_is_measured_and_the_emulation_chosen_with_a_notice(monkeypatch, fresh_probes):
    calls = _slow_scaled_mm(monkeypatch, 0.005)         # 5 ms a call: ~100x a 32^3 emulated matmul
    mp, notices = _engine()
    assert mp.fp8_report.backend == "emulate"
    assert all(layer.backend == "emulate" for layer in mp.model if hasattr(layer, "backend"))
    assert len(notices) == 1
    assert "measured" in str(notices[0].message) and "backend=scaled_mm" in str(notices[0].message)
    assert "measured" in str(mp.fp8_report)
    # Cheap: the capability probe's two calls, then two timed calls decide a gap this large.
    assert len(calls) == 4
    # Cached for the process: a second engine measures nothing and decides alike.
    again, _ = _engine()
    assert len(calls) == 4 and again.fp8_report.backend == "emulate"


@needs_scaled_mm
def test_the_recipe_overrides_the_measured_choice(monkeypatch, fresh_probes):
    calls = _slow_scaled_mm(monkeypatch, 0.005)
    forced, notices = _engine("fp8,fp8=current(backend=scaled_mm)")
    assert forced.fp8_report.backend == "scaled_mm" and not notices
    assert _time_fp8.cache_info().currsize == 0 and len(calls) == 2   # capability only: nothing timed
    calls.clear()
    emulated, notices = _engine("fp8,fp8=current(backend=emulate)")
    assert emulated.fp8_report.backend == "emulate" and not notices and not calls   # no probe at all


@needs_scaled_mm
def test_a_sound_kernel_keeps_scaled_mm(monkeypatch, fresh_probes):
    # The measurement itself, with the emulation's side made slow instead: scaled_mm must win.
    real_mm = torch.mm

    def slow_mm(*args, **kwargs):
        time.sleep(0.005)
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", slow_mm)
    speed = probe_fp8_speed("cpu")
    monkeypatch.setattr(torch, "mm", real_mm)
    assert speed.ratio < 0.5 and speed.size == 32
    mp, notices = _engine()
    assert mp.fp8_report.backend == "scaled_mm" and not notices
    assert "chosen on cpu by a measured probe" in mp.fp8_report.note


@needs_scaled_mm
def test_the_speed_probe_inside_fake_mode_times_real_tensors(fresh_probes):
    with FakeTensorMode():
        inside = probe_fp8_speed("cpu")
    assert inside is probe_fp8_speed("cpu") and inside.scaled_mm_s > 0 and inside.emulate_s > 0


def test_nothing_is_timed_where_scaled_mm_cannot_run(monkeypatch, fresh_probes):
    import mixprec.devices as devices
    monkeypatch.setattr(devices, "probe_scaled_mm", lambda device: devices.Support(False, "no fp8 here"))
    assert probe_fp8_speed("cpu") is None and _time_fp8.cache_info().currsize == 0


@needs_scaled_mm
def test_the_speed_probe_leaves_the_rng_threads_and_autocast_as_they_were(fresh_probes):
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        speed = probe_fp8_speed("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert torch.equal(torch.rand(3), want)        # the model's initialisation after it is unchanged
    assert torch.get_num_threads() == threads and speed.emulate_s > 0

"""The fp8 capability probe is never decided inside a fake-tensor trace (memory_report, inspect)."""

import warnings

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec import Fp8EmulationWarning, MixedPrecision, memory_report
from mixprec.devices import _probe, probe_scaled_mm


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def _fresh_probe():
    _probe.cache_clear()
    support = probe_scaled_mm("cpu")
    _probe.cache_clear()
    return support


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
        assert mp.fp8_report.backend == ("scaled_mm" if truth.ok else "emulate")
        assert bool(emulated) == (not truth.ok)
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

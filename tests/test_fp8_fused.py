"""The fused eager fp8 cast (fp8/fused.py) gives the eager casts' numbers bit for bit, in both layouts,
and falls back to them, with one notice, where torch.compile cannot build it.

On CPU Inductor emits C++ (slow to build: these tests compile the cast once per process, ~30 s).
"""

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from mixprec.fp8 import Fp8Linear, probe_scaled_mm
from mixprec.fp8 import fused as fused_mod
from mixprec.fusion import FusedFunction, FusionWarning
from mixprec.recipe import Fp8Config

pytestmark = pytest.mark.skipif(not probe_scaled_mm("cpu").ok,
                                reason="torch._scaled_mm does not run on this CPU build")


def _twins(config):
    torch.manual_seed(0)
    base = nn.Linear(48, 32)
    eager = Fp8Linear.from_linear(base, config, "scaled_mm")
    twin = nn.Linear(48, 32)
    twin.load_state_dict(base.state_dict())
    fused = Fp8Linear.from_linear(twin, config, "scaled_mm")
    assert not eager.fused_casts          # the default on every device: eager casts
    fused.fused_casts = True
    return eager, fused


@pytest.mark.parametrize("config", [Fp8Config(), dataclasses.replace(Fp8Config.parse("delayed"), history=4)],
                         ids=["current", "delayed"])
def test_fused_layer_equals_eager_layer_bit_for_bit_over_steps(config):
    eager, fused = _twins(config)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        # Rows of different magnitude each step, and a different M: dynamic shapes, moving amaxes.
        x = torch.randn(8 + 4 * step, 48, generator=g) * (10.0 ** step)
        gy = torch.randn(8 + 4 * step, 32, generator=g)
        outs = []
        for layer in (eager, fused):
            xi = x.clone().requires_grad_(True)
            y = layer(xi)
            y.backward(gy)
            outs.append((y, xi.grad, layer.weight.grad.clone(), layer.fp8_state()))
            layer.weight.grad = layer.bias.grad = None
        (y_e, gx_e, gw_e, st_e), (y_f, gx_f, gw_f, st_f) = outs
        assert torch.equal(y_e, y_f) and torch.equal(gx_e, gx_f) and torch.equal(gw_e, gw_f)
        for name in st_e:
            assert torch.equal(st_e[name], st_f[name]), (step, name)
    if config.delayed:
        assert float(fused.input_history[2]) > 0      # three amaxes recorded, newest first


def test_fused_cast_writes_both_layouts_of_the_same_fp8_values():
    scale, amax = torch.ones(()), torch.zeros(())
    x = torch.randn(24, 40)
    from mixprec.formats import FP8_E4M3
    q, q_t, s, _ = fused_mod.fused_cast(x, scale, amax, None, FP8_E4M3, algo="max", margin=0, pow2=False,
                                     record=True, want_t=True)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (24, 40) and q.is_contiguous()
    assert q_t.shape == (40, 24) and q_t.is_contiguous() and torch.equal(q_t.float(), q.float().t())
    amax_x = x.abs().max()
    # the correctly rounded fp32 quotient (float64's rounded once more), recorded
    assert float(amax) == float(amax_x) and float(s) == float(torch.tensor(448.0 / float(amax_x)).float())


@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_compiled_scale_is_the_correctly_rounded_quotient(delayed):
    # Inductor could lower fmax / amax as reciprocal-then-multiply (two roundings, one ulp off in about
    # a quarter of amaxes); the compiled cast must give fl32(fmax / amax) like the eager one.
    from mixprec.formats import FP8_E4M3
    g = torch.Generator().manual_seed(33)
    base = torch.randn(4, 8, generator=g)
    factors = torch.exp(torch.randn(150, generator=g, dtype=torch.float64) * 6).float()
    wrong = []
    for f in factors:
        x = base * f
        history = torch.zeros(2) if delayed else None
        _, _, s, amax = fused_mod.fused_cast(x, torch.ones(()), torch.zeros(()), history, FP8_E4M3,
                                             algo="max", margin=0, pow2=False, record=False, want_t=False)
        want = torch.tensor(448.0 / float(amax)).float()       # float64 quotient, rounded once to fp32
        wrong += [] if torch.equal(s, want) else [(float(amax), float(s), float(want))]
    assert not wrong, f"{len(wrong)} of {len(factors)} scales off, e.g. {wrong[:3]}"


def test_a_compiler_failure_falls_back_to_the_eager_casts_with_one_notice(monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler found")
    fresh = FusedFunction(fused_mod._cast_role, "fp8 cast")
    fresh._compiled = broken                  # as if torch.compile had failed to build it
    monkeypatch.setattr(fused_mod, "_fused_cast_role", fresh)
    eager, fused = _twins(Fp8Config())
    x = torch.randn(8, 48)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, y2 = fused(x), fused(x)
    notes = [w for w in caught if issubclass(w.category, FusionWarning)]
    assert len(notes) == 1 and "no C++ compiler found" in str(notes[0].message)
    assert "fp8 cast" in str(notes[0].message) and fresh.broken.startswith("RuntimeError")
    assert torch.equal(y1, eager(x)) and torch.equal(y2, y1)


def test_one_graph_serves_every_batch_size_and_weight_shape():
    # Two layers of different weight shapes, three batch sizes, training only: the graphs differ by
    # the input's dtype and the role's format and layout, never by a shape (weights go in detached).
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    layers = [Fp8Linear.from_linear(nn.Linear(48, 32), Fp8Config(), "scaled_mm"),
              Fp8Linear.from_linear(nn.Linear(32, 16), Fp8Config(), "scaled_mm")]
    for layer in layers:
        layer.fused_casts = True
    for batch in (8, 12, 20):
        x = torch.randn(batch, 48, requires_grad=True)
        out = layers[1](layers[0](x))
        out.backward(torch.randn_like(out))   # (sum()'s gradient would be a stride-0 expand: a 3rd graph)
    graphs = len(_debug_get_cache_entry_list(fused_mod._cast_role.__code__))
    # input and weight (e4m3, transposed copy wanted) share one; grad_output (e5m2) is the other.
    assert graphs == 2, graphs

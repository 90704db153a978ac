"""fp8 recipes in the engine: which layers are swapped and why, errors that name the layer, the emulation
notice, scale state in state_dict, per-layer underflow/saturation, and the lab accepting the recipes."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Fp8Config, Fp8EmulationWarning, MixedPrecision, get_recipe, parse_recipe, supports
from mixprec.fp8 import Fp8Linear, Fp8Reason, count_fp8_ranges, fp8_layer_stats
from conftest import same_nested as _same


class Net(nn.Module):
    """Linears of every kind: eligible, misshapen, a subclass, nested, and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2))
        self.odd = nn.Linear(64, 24)                 # 24 is not a multiple of 16
        self.ln = nn.LayerNorm(24)
        self.sub = _MyLinear(24, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.sub(self.ln(self.odd(x))))


class _MyLinear(nn.Linear):
    pass


def engine(recipe="fp8", **kwargs):
    model = Net()
    return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe, **kwargs)


def step(mp, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 16, (8,), generator=g)
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y)
    mp.backward(loss)
    mp.step()
    mp.zero_grad()
    return loss


def test_a_skip_pattern_matching_no_linear_is_refused_before_anything_changes():
    # fp8=current(skip=blocks.*.atn) was accepted: the layers it meant to keep out went fp8.
    model = Net()
    with pytest.raises(ValueError, match=r"fp8 skip='blocks\.\*\.0\.x' matches no nn.Linear of Net .*did you mean"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       "compute=bf16,fp8=current(skip=blocks.*.0.x)")
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())      # nothing was swapped
    with pytest.raises(ValueError, match=r"fp8 skip='lm_head' matches no nn.Linear of Net .*did you mean 'head'\?"):
        engine("compute=bf16,fp8=current(skip=lm_head)")


def test_swap_report_says_what_was_swapped_and_why_not():
    params_before = [id(p) for p in Net().parameters()]
    mp = engine("compute=bf16,fp8=current(skip=blocks.1.*,skip_last=true)")
    report = mp.fp8_report
    assert report.swapped == ("inp", "blocks.0.0")
    assert report.not_swapped == {"blocks.1.0": Fp8Reason.SKIP, "odd": Fp8Reason.SHAPE,
                                  "sub": Fp8Reason.SUBCLASS, "head": Fp8Reason.LAST}
    assert isinstance(mp.model.inp, Fp8Linear) and type(mp.model.blocks[1][0]) is nn.Linear
    text = str(report)
    assert "2 of 6 linear layers swapped" in text
    assert "blocks.1.*" in text and "(24, 64)" in text and "pad to (32, 64)" in text and "_MyLinear" in text
    # The optimizer's parameters are the model's, unchanged; state_dict keys are nn.Linear's.
    assert [id(p) for p in mp.model.parameters()] == [id(p) for p in mp.optimizer.param_groups[0]["params"]]
    assert len(params_before) == len(list(mp.model.parameters()))
    assert list(mp.model.state_dict()) == list(Net().state_dict())
    loss = step(mp)
    assert torch.isfinite(loss)


def test_filter_function_and_skip_first():
    mp = engine("compute=bf16,fp8=current(skip_first=true)", fp8_filter=lambda name, m: name != "head")
    assert mp.fp8_report.swapped == ("blocks.0.0", "blocks.1.0")
    assert mp.fp8_report.not_swapped["inp"] is Fp8Reason.FIRST
    assert mp.fp8_report.not_swapped["head"] is Fp8Reason.FILTER


def test_forcing_a_misshapen_layer_names_it_and_its_shape():
    with pytest.raises(ValueError, match=r"'odd'.*\(24, 64\).*multiples of 16.*\(32, 64\)"):
        engine("compute=bf16,fp8=current(force=odd)")
    with pytest.raises(ValueError, match="no nn.Linear of that name; did you mean 'head'"):
        engine("compute=bf16,fp8=current(force=haed)")
    with pytest.raises(ValueError, match="only plain nn.Linear"):
        engine("compute=bf16,fp8=current(force=sub)")
    forced = engine("compute=bf16,fp8=current(force=head,skip_last=true)").fp8_report
    assert "head" in forced.swapped and "fp8 (forced)" in str(forced)


def test_fp8_filter_needs_an_fp8_recipe():
    with pytest.raises(ValueError, match="has no fp8"):
        engine("bf16", fp8_filter=lambda n, m: True)


def test_without_fp8_matmuls_the_emulation_runs_with_one_notice(monkeypatch):
    no = mixprec.Support(False, "pretend device without fp8")
    monkeypatch.setattr(mixprec.devices, "probe_scaled_mm", lambda device: no)
    with pytest.warns(Fp8EmulationWarning, match="emulated on cpu.*pretend device") as record:
        mp = engine("fp8")
    assert len(record) == 1 and mp.fp8_report.backend == "emulate"
    assert "emulated" in str(mp.fp8_report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(2):
            step(mp, i)                        # no further notice while training
    with pytest.raises(ValueError, match="cannot run on cpu: pretend device"):
        engine("compute=bf16,fp8=current(backend=scaled_mm)")
    assert not supports(get_recipe("compute=bf16,fp8=current(backend=scaled_mm)"), "cpu").ok
    assert supports(get_recipe("fp8"), "cpu").ok


@pytest.mark.parametrize("recipe", ["fp8-delayed", "params=bf16,compute=bf16,master=fp32,fp8=delayed(history=4)",
                                    "compute=fp16,fp8=current"])
def test_state_dict_round_trips_the_scale_state(recipe):
    mp = engine(recipe)
    for i in range(3):
        step(mp, i)
    state = mp.state_dict()
    assert set(state["fp8"]) == set(mp.fp8_report.swapped)
    fresh = engine(recipe)
    fresh.model.load_state_dict(mp.model.state_dict())
    fresh.load_state_dict(state)
    for name, layer_state in state["fp8"].items():
        for key, value in layer_state.items():
            assert torch.equal(getattr(fresh.model.get_submodule(name), key), value), (name, key)
    if "delayed" in recipe:
        hist = state["fp8"]["inp"]["input_history"]
        assert (hist[:3] > 0).all() and (hist[3:] == 0).all()     # three steps recorded, newest first
    other = engine("compute=bf16,fp8=delayed(history=8)") if "delayed" in recipe else None
    if other is not None:
        with pytest.raises(ValueError, match="saved under recipe"):
            other.load_state_dict(state)


def test_layer_stats_count_underflow_and_saturation_exactly():
    layer = nn.Sequential(nn.Linear(16, 16, bias=False))
    MixedPrecision(layer, torch.optim.SGD(layer.parameters(), lr=0.0),   # swaps in the Fp8Linear
                   "compute=bf16,fp8=delayed(history=2,pow2=true)")
    assert count_fp8_ranges(layer) == 1
    x1 = torch.ones(4, 16)                       # amax 1: first step uses its own amax -> scale 256
    layer(x1).sum().backward()
    # Second step: history says amax 1, so the scale stays 256, but the input now reaches 4:
    # 4 * 256 = 1024 > 448 saturates (16 values); 1e-6 * 256 = 2.6e-4 <= 2**-9 / 2 = 9.8e-4 (half
    # e4m3's smallest subnormal) flushes to zero (16 values); 5e-6 * 256 = 1.3e-3 rounds up to 2**-9.
    x2 = torch.ones(4, 16)
    x2[0] = 4.0
    x2[1] = 1e-6
    x2[2] = 5e-6
    layer(x2).sum().backward()
    (stats,) = fp8_layer_stats(layer)
    t = stats.tensor("input")
    assert (t.scale, t.amax, t.history_amax) == (256.0, 4.0, 4.0)
    assert t.headroom_bits == math.log2(448 / 1024) and t.saturates
    assert t.flush_below == 2.0**-9 / 2 / 256
    assert t.counted == 128 and t.saturated_fraction == 16 / 128 and t.flushed_fraction == 16 / 128
    assert stats.tensor("weight").saturated_fraction == 0.0
    assert stats.tensor("grad_output").format == "fp8_e5m2"
    with pytest.raises(ValueError, match="valid roles"):
        stats.tensor("bias")


def test_values_that_round_down_to_the_max_do_not_count_as_saturated():
    layer = nn.Sequential(nn.Linear(16, 16, bias=False))
    MixedPrecision(layer, torch.optim.SGD(layer.parameters(), lr=0.0),
                   "compute=bf16,fp8=delayed(history=2,pow2=true)")
    count_fp8_ranges(layer)
    layer(torch.ones(4, 16)).sum().backward()     # scale 256 from amax 1
    # At scale 256: 1.8125 -> 464, the tie above e4m3's 448, rounds to even 448 (not saturated);
    # 1.8 -> 460.8 rounds to 448 too; 1.82 -> 465.9 would round to 480 > 448: saturated.
    x2 = torch.ones(4, 16)
    x2[0, :4] = 1.8125
    x2[0, 4:8] = 1.8
    x2[0, 8:12] = 1.82
    layer(x2).sum().backward()
    (stats,) = fp8_layer_stats(layer)
    assert stats.tensor("input").saturated_fraction == 4 / 128
    assert fp8_layer_stats(nn.Linear(4, 4)) == ()


def test_recipes_reach_the_lab_and_devices():
    from mixprec.lab.compare.run import plan_compare
    plan = plan_compare("mlp", ["fp8", "fp8-delayed", "bf16"], steps=5, device="cpu")
    assert [r.label for r in plan.recipes] == ["fp8", "fp8-delayed", "bf16"]
    assert supports(parse_recipe("fp8-delayed"), "cpu").ok
    assert Fp8Config.parse("current") == get_recipe("fp8").fp8


def test_cli_compares_fp8_recipes_and_refuses_bad_ones_in_one_line(capsys):
    from mixprec.lab.cli import main
    saved = torch.get_num_threads()
    try:
        assert main(["compare", "--recipes", "bf16,fp8,compute=bf16,fp8=delayed(history=4,pow2=true)",
                     "--steps", "3", "--device", "cpu", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(saved)
    out = capsys.readouterr().out
    assert "fp8 " in out and "fp8=delayed(history=4,pow2=true)" in out
    assert main(["compare", "--recipes", "compute=bf16,fp8=delayed(amax=mean)"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mixprec: error: unknown fp8 amax 'mean'; valid values: max, recent"]


class _Experts(nn.Module):
    """A mixture of experts' weights as one 3-D tensor, multiplied in its own forward (Mixtral's layout)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 32, 32) / 6)     # (experts, out, in)

    def forward(self, x, expert):                            # x (B, 32), expert (B,)
        return torch.einsum("boi,bi->bo", self.w[expert], x)


class _Moe(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 32)
        self.conv = nn.Conv1d(32, 32, 1)
        self.router = nn.Parameter(torch.randn(4, 32) / 6)    # (experts, in): F.linear in forward
        self.experts = _Experts()
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)

    def forward(self, ids):                                  # (B,)
        x = self.conv(self.embed(ids)[:, :, None])[:, :, 0]
        expert = F.linear(x, self.router).argmax(-1)
        return self.head(self.norm(self.experts(x, expert)))


def test_the_report_names_every_weight_outside_linear_layers_with_the_reason():
    model = _Moe()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "fp8")
    report = mp.fp8_report
    assert report.swapped == ("head",)
    # Every 2-D+ weight but the head's, in module order; biases and the norm's scale are not weights.
    assert [(u.name, u.shape) for u in report.uncovered] == [
        ("router", (4, 32)), ("embed.weight", (16, 32)), ("conv.weight", (32, 32, 1)), ("experts.w", (4, 32, 32))]
    why = {u.name: u.reason for u in report.uncovered}
    assert why["embed.weight"].startswith("an embedding")
    assert why["conv.weight"].startswith("a convolution (Conv1d)")
    assert why["experts.w"].startswith("3-D, multiplied in _Experts.forward (per-expert")
    assert why["router"].startswith("multiplied in _Moe.forward, not an nn.Linear")
    # 128 + 512 + (1024 + 32) + 4096 + 64 + (512 + 16) parameters; fp8 holds the head's 512 weights.
    assert report.parameters == 6384 and report.fp8_fraction == 512 / 6384
    text = str(report)
    assert "1 of 1 linear layers swapped (8% of the parameters)" in text
    assert "not covered: 4 weights outside linear layers (90% of the parameters)" in text   # 5760 / 6384
    assert "experts.w" in text and "(4, 32, 32)" in text
    ids = torch.arange(8)
    with mp.autocast():
        loss = F.cross_entropy(model(ids), ids)
    mp.backward(loss)
    mp.step()                                                # it still trains, experts in the base recipe


def test_a_tied_weight_counts_as_its_linear():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.head = nn.Linear(16, 32, bias=False)
            self.head.weight = self.embed.weight              # GPT-2's tying: one (32, 16) Parameter

    model = Tied()
    report = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8").fp8_report
    assert report.swapped == ("head",) and report.uncovered == () and report.fp8_fraction == 1.0


@pytest.mark.parametrize("recipe", ["fp8", "fp8-delayed", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"])
def test_an_empty_batch_trains_as_bf16_does_and_leaves_the_scale_state_alone(recipe):
    # Issue 33: 0 rows raised from inside torch (the inf-norm or amax() of an empty tensor, a stride
    # check in torch._scaled_mm). Now: zero gradients, the step taken, no scale state made from it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Fp8EmulationWarning)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)

    def train(rows):
        with mp.autocast():
            loss = model(torch.randn(rows, 64)).float().pow(2).sum()
        mp.backward(loss)
        grads = [p.grad.clone() for p in model.parameters()]
        result = mp.step()
        mp.zero_grad()
        return grads, result

    train(8)
    before = copy.deepcopy(mp.state_dict()["fp8"])
    weights = [p.detach().clone() for p in model.parameters()]
    grads, result = train(0)
    assert not result.skipped and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))    # SGD, zero grads
    after = mp.state_dict()["fp8"]
    assert _same(before, after)
    grads, result = train(8)                                            # and training goes on
    assert all(torch.isfinite(g).all() for g in grads) and not result.skipped


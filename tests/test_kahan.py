"""bf16-kahan: bf16 weights plus int16 compensations hold the fp32 value exactly (against a float64
reference), step it as an fp32 master would, skip without a trace, and checkpoint bit for bit."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import OPTIMIZERS, batches, tiny_model
from mixprec import CheckpointError, MixedPrecision, get_recipe, load_checkpoint, parse_recipe, save_checkpoint
from mixprec.checkpoint.verified import read_verified, write_verified
from mixprec.step.grad_sync import _check_fsdp_recipe
from mixprec.update.kahan import add_compensation_, split_
from mixprec.update.master import MasterWeights
from mixprec.recipe import Rounding


# ------------------------------------------------------------------------------- the arithmetic
def _reference(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Nearest bf16 (ties away from zero) and the rounding error of the magnitude in fp32 ulps of x's
    binade (the bit patterns are sign and magnitude), in float64: no bit tricks. bf16 keeps 8
    significant bits, fp32 24; both bottom out at exponent -126. For finite x only."""
    a = np.abs(x.double().numpy())
    e = np.maximum(np.frexp(a)[1] - 1, -126)               # a in [2**e, 2**(e+1)) (or subnormal)
    ulp16, ulp32 = np.exp2(e - 7.0), np.exp2(e - 23.0)
    w = np.floor(a / ulp16 + 0.5) * ulp16
    c = (a - w) / ulp32                                    # exact: every number here is a float64
    w = np.where(w >= 2.0**128, np.inf, w)                 # above bf16's range: inf
    return np.copysign(w, x.double().numpy()), c


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    comp = torch.empty(x.numel(), dtype=torch.int16)
    w = split_(x.clone(), comp, [[0, 0, x.numel()]]).clone()
    return w, comp


def _patterns(values) -> torch.Tensor:
    return torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32).view(torch.float32)


def test_split_is_nearest_with_ties_away_and_joins_back_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (400_000,), dtype=torch.int64, generator=g).to(torch.int32)
    edges = _patterns([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,    # ties, even and odd high half
                       0x3F807FFF, 0x3F7FFFFF, 0x3F7F8000,                  # just below a tie; across 1.0
                       0x00000001, 0x80000001, 0x00008000, 0x007FFFFF,      # subnormals
                       0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0xFF7FFFFF,      # near bf16's largest: inf or not
                       0x00000000, 0x80000000, 0x7F800000, 0xFF800000])     # zeros, infs
    x = torch.cat([bits.view(torch.float32), edges])
    x = x[~x.isnan()]
    w, comp = _split(x)
    finite = torch.isfinite(x)
    w_ref, c_ref = _reference(x[finite])
    assert np.array_equal(w[finite].double().numpy(), w_ref)
    assert torch.equal(w[~finite].float(), x[~finite]) and not comp[~finite].any()
    assert np.array_equal(torch.signbit(w).numpy(), torch.signbit(x).numpy())   # -0.0 stays -0.0
    assert np.array_equal(comp[finite].numpy(), c_ref)
    y = w.float()
    add_compensation_(y, comp, [[0, 0, x.numel()]])
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))
    # The ties: 1 + 2**-8 rounds up to 1 + 2**-7 (away), where round-to-nearest-even gives 1.0.
    assert w[-19].item() == 1 + 2**-7 and x[-19:-18].bfloat16().item() == 1.0 and comp[-19] == -32768


def test_nan_splits_into_a_nan_weight():
    x = torch.tensor([math.nan, 1.0]).clone()
    x.view(torch.int32)[0] = 0x7FFFFFFF          # a NaN whose pattern + 0x8000 would overflow int32
    w, comp = _split(x)
    assert w[0].isnan() and w[1].item() == 1.0 and comp.tolist() == [0, 0]


# ------------------------------------------------------------------------------ in the engine
def _walk(recipe: str, steps: int = 1000) -> torch.Tensor:
    """256 weights at 1.0, each step +1e-4 (SGD, gradient -1): the final weights (fp32 view for kahan)."""
    model = nn.Linear(256, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-4), recipe)
    for _ in range(steps):
        with mp.autocast():
            loss = -model(torch.ones(1, 256)).sum()      # every weight's gradient is exactly -1
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    if recipe == "bf16-kahan":
        (x,) = mp.master.kahan.fp32_weights()
        assert torch.equal(model.weight, x.bfloat16())   # the weight is the fp32 value's nearest bf16
        return x.flatten()
    return model.weight.detach().float().flatten()


@pytest.mark.slow     # 3000 engine steps: ~5 s on 2 cores
def test_a_thousand_small_updates_land_where_fp32_lands():
    # 1e-4 is below half a bf16 ulp at 1.0 (2**-8): round to nearest drops every update, stochastic
    # rounding keeps them on average but scatters each weight, Kahan keeps them all, as fp32 does.
    fp32 = torch.ones(256, requires_grad=True)
    sgd = torch.optim.SGD([fp32], lr=1e-4)
    for _ in range(1000):
        fp32.grad = torch.full((256,), -1.0)
        sgd.step()
    nearest = _walk("params=bf16,compute=bf16,master=none")
    sr = _walk("bf16-sr")
    kahan = _walk("bf16-kahan")
    assert bool((nearest == 1.0).all())
    assert abs(sr.double().mean().item() - 1.1) < 0.01 and sr.max() - sr.min() >= 2**-7   # noisy
    assert torch.equal(kahan.view(torch.int32), fp32.detach().view(torch.int32))          # fp32's bits
    assert abs(kahan[0].item() - 1.1) <= 1000 * 2**-24     # fp32's own rounding: half an ulp per add


def _train(recipe, opt="adamw-foreach", steps=6, plant=None, observe=False, data_seed=1):
    model = tiny_model(seed=0)
    mp = MixedPrecision(model, OPTIMIZERS[opt](model.parameters()), recipe, seed=3)
    if observe:          # a step observer makes the engine fill the fp32 copies whole (master_whole)
        mp.add_step_observer(type("Obs", (), {"before_step": lambda s, e: None,
                                              "after_step": lambda s, e, f: None})())
    for step, (x, y) in enumerate(batches(steps, seed=data_seed)):
        if plant is False and step == 2:
            continue                                      # the twin never sees the bad batch
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        if plant and step == 2:
            next(model.parameters()).grad.view(-1)[0] = math.inf
        assert mp.step().skipped == bool(plant and step == 2)
        mp.zero_grad()
    return mp


def _fp32_view(mp) -> list[torch.Tensor]:
    if mp.master.kahan is not None:
        return mp.master.kahan.fp32_weights()
    return [m.detach() for m in mp.master.masters]


@pytest.mark.parametrize("opt", ["adamw-foreach", "adamw-fused", "sgd-momentum", "sgd-momentum-fused"])
def test_kahan_steps_the_fp32_values_bf16_pure_steps(opt):
    # The optimizer sees the same fp32 values as bf16-pure's masters, so both trajectories agree bit
    # for bit (weights too: none of these fp32 values lands on a bf16 tie, where the two round apart).
    pure, kahan = _train("bf16-pure", opt), _train("bf16-kahan", opt)
    for a, b in zip(_fp32_view(pure), _fp32_view(kahan)):
        assert torch.equal(a, b)
    for a, b in zip(pure.model.state_dict().values(), kahan.model.state_dict().values()):
        assert torch.equal(a, b)
    assert all(m.numel() == 0 for m in kahan.master.masters)      # no fp32 copy held between steps


def test_memory_counts_the_compensation_and_export_gives_the_exact_fp32_values():
    from mixprec.diagnostics.memory import state_bytes
    from mixprec.checkpoint.export import fp32_state_dict
    pure, kahan = _train("bf16-pure", "adamw-foreach"), _train("bf16-kahan", "adamw-foreach")
    n = sum(p.numel() for p in kahan.master.kahan.params)
    assert state_bytes(kahan).master == 2 * n                   # the other half of an fp32 master
    exported, masters = fp32_state_dict(kahan), fp32_state_dict(pure)
    assert exported.keys() == masters.keys()
    for key in exported:                                          # bf16-pure's masters, bit for bit
        assert exported[key].dtype == torch.float32 and torch.equal(exported[key], masters[key]), key


def test_foreach_and_fused_agree_as_they_do_under_bf16_pure():
    views = {(r, o): _fp32_view(_train(r, o)) for r in ("bf16-pure", "bf16-kahan")
             for o in ("adamw-foreach", "adamw-fused")}
    for recipe in ("bf16-pure", "bf16-kahan"):
        a, b = views[recipe, "adamw-foreach"], views[recipe, "adamw-fused"]
        assert all(torch.allclose(x, y, rtol=0, atol=1e-6) for x, y in zip(a, b))
    same = lambda r: [torch.equal(x, y) for x, y in zip(views[r, "adamw-foreach"], views[r, "adamw-fused"])]
    assert same("bf16-kahan") == same("bf16-pure")


@pytest.mark.parametrize("opt, observe", [("adamw-fused", False), ("sgd-momentum", False),
                                          ("adamw-foreach", True)])
def test_a_skipped_step_leaves_weights_compensation_and_optimizer_as_if_never_seen(opt, observe):
    # Host-decided fused, the generic path, and the fp32 copies filled whole (rounded back after a skip).
    a = _train("bf16-kahan", opt, plant=True, observe=observe)
    b = _train("bf16-kahan", opt, plant=False, observe=observe)
    for x, y in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(x, y)
    assert torch.equal(a.master.kahan.comp, b.master.kahan.comp)
    for sa, sb in zip(a.optimizer.state_dict()["state"].values(), b.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)


def test_a_step_skipped_inside_the_fused_kernel_rewrites_the_same_bits():
    # The device-decided skip (found_inf handed to the kernel): the pair is joined, left unstepped and
    # split again, which gives back the same weight and compensation whatever they were.
    model = tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mw = MasterWeights(list(model.parameters()), opt, keep=False, rounding=Rounding.KAHAN)
    model.bfloat16()
    weights, comp = [p.detach().clone() for p in model.parameters()], mw.kahan.comp.clone()
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e30)
    opt.grad_scale, opt.found_inf = None, torch.tensor(1.0)
    mw.step(opt, opt.step)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert torch.equal(mw.kahan.comp, comp) and comp.any()
    assert all("exp_avg" not in s or not s["exp_avg"].any() for s in opt.state.values())


def test_the_first_fp32_view_is_the_initial_fp32_weights():
    model = tiny_model(seed=0)
    initial = [p.detach().clone() for p in model.parameters()]
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-kahan")
    low = [x for x, p in zip(initial, model.parameters()) if p.dtype == torch.bfloat16]
    assert len(low) == 4 and all(torch.equal(a, b) for a, b in zip(low, mp.master.kahan.fp32_weights()))
    assert mp.master.kahan.nbytes == 2 * sum(x.numel() for x in low)      # 2 B/param beside the weights


def test_a_weight_zeroed_outside_the_step_does_not_join_into_a_nan():
    # -0.0 joined with a negative compensation is 0x7FFFxxxx, a NaN: a parameter written through
    # (its version moved) is the truth: its compensations are reset before the join, with a note.
    mp = _train("bf16-kahan", steps=2)
    weight = mp.model[0].weight
    assert (mp.master.kahan.state_dict()[0] < 0).any()
    with torch.no_grad():
        weight.mul_(0.0)                                # -0.0 where the weight was negative
    x, y = batches(1, seed=9)[0]
    with mp.autocast():
        mp.backward(F.cross_entropy(mp.model(x), y))
    with pytest.warns(UserWarning, match="compensations were reset"):
        assert not mp.step().skipped
    assert all(torch.isfinite(v).all() for v in mp.master.kahan.fp32_weights())
    assert torch.isfinite(weight).all()


def test_the_join_of_a_finite_weight_is_finite_whatever_the_compensation():
    # Every bf16 pattern x every 16th compensation: a zero with c < 0 (no split makes it) joins to
    # +0.0, every other pair to (w << 16) + c exactly, so a finite weight never joins into a NaN/inf.
    # The 2**28 pairs are joined 2**11 weight patterns at a time (a whole pass at once peaked at 14 GB
    # of temporaries); every pair is still checked.
    c = torch.arange(-32768, 32768, 16, dtype=torch.int32).to(torch.int16)
    for start in range(-32768, 32768, 2048):
        w = torch.arange(start, start + 2048, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        wf = w.repeat_interleave(c.numel()).float()
        comp = c.repeat(w.numel())
        joined = wf.clone()
        add_compensation_(joined, comp, [[0, 0, joined.numel()]])
        expect = wf.view(torch.int32).long() + comp.long()
        zero = (wf == 0) & (comp < 0)
        assert torch.equal(joined.view(torch.int32).long()[~zero], ((expect + 2**31) % 2**32 - 2**31)[~zero])
        assert (joined.view(torch.int32)[zero] == 0).all()
        finite = torch.isfinite(wf.bfloat16()) & torch.isfinite(wf)
        assert torch.isfinite(joined[finite]).all()


def test_a_weight_zeroed_through_data_does_not_join_into_a_nan():
    # .data moves no version counter, so the old compensations stay; the join still gives +0.0
    # (before issue 33 half the weights turned NaN on the next step).
    mp = _train("bf16-kahan", steps=2)
    weight = mp.model[0].weight
    assert (mp.master.kahan.state_dict()[0] < 0).any()
    weight.data.zero_()
    x, y = batches(1, seed=9)[0]
    with mp.autocast():
        mp.backward(F.cross_entropy(mp.model(x), y))
    assert not mp.step().skipped
    assert all(torch.isfinite(v).all() for v in mp.master.kahan.fp32_weights())
    assert torch.isfinite(weight).all()


# ------------------------------------------------------------------------ state and checkpoints
def test_checkpoint_round_trip_and_resume_are_bit_for_bit(tmp_path):
    whole = _train("bf16-kahan", "adamw-fused", steps=6, plant=True)
    half = _train("bf16-kahan", "adamw-fused", steps=3, plant=True)
    path = save_checkpoint(tmp_path / "ck.pt", half)
    model = tiny_model(seed=5)                          # other weights: the load must replace them all
    resumed = MixedPrecision(model, OPTIMIZERS["adamw-fused"](model.parameters()), "bf16-kahan", seed=3)
    load_checkpoint(path, resumed)
    for a, b in zip(half.master.kahan.state_dict(), resumed.master.kahan.state_dict()):
        assert a.dtype == torch.int16 and torch.equal(a, b)
    for x, y in batches(6)[3:]:
        with resumed.autocast():
            loss = F.cross_entropy(model(x), y)
        resumed.backward(loss)
        resumed.step()
        resumed.zero_grad()
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(whole.master.kahan.comp, resumed.master.kahan.comp)


@pytest.mark.parametrize("damage, words", [
    (lambda c: c.pop(), ["holds 3 tensors", "4 bf16 weights"]),
    (lambda c: c.__setitem__(1, c[1].float()), ["compensation 1 is torch.float32", "torch.int16"]),
    (lambda c: c.__setitem__(0, c[0].T.contiguous()), ["compensation 0", "(8, 16)", "(16, 8)"]),
    (lambda c: c.__setitem__(2, "zeros"), ["compensation 2 is str"]),
])
def test_a_malformed_compensation_is_refused_and_changes_nothing(tmp_path, damage, words):
    path = save_checkpoint(tmp_path / "ck.pt", _train("bf16-kahan", steps=2))
    state = read_verified(path, torch.device("cpu"))
    damage(state["mixprec"]["master"]["compensation"])
    write_verified(path, state)
    mp = _train("bf16-kahan", steps=1, data_seed=4)
    before = (copy.deepcopy(mp.model.state_dict()), mp.master.kahan.comp.clone())
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, mp)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), mp.model.state_dict().values()))
    assert torch.equal(before[1], mp.master.kahan.comp)
    missing = mp.state_dict()
    del missing["master"]["compensation"]
    with pytest.raises(ValueError, match="Kahan compensation state is NoneType"):
        mp.load_state_dict(missing)


# ---------------------------------------------------------------------- recipe, compile, FSDP2
def test_the_recipe_parses_prints_and_refuses_what_it_cannot_do():
    r = get_recipe("bf16-kahan")
    assert r.rounding is Rounding.KAHAN and r.master is None and str(r).endswith("rounding=kahan")
    assert parse_recipe("params=bf16,compute=bf16,rounding=kahan").name == "bf16-kahan"
    assert parse_recipe("bf16-sr,rounding=kahan").name == "bf16-kahan"
    with pytest.raises(ValueError, match="rounding=kahan applies to .* without a master copy"):
        parse_recipe("bf16-pure,rounding=kahan")
    with pytest.raises(ValueError, match="rounding=kahan is implemented for bf16 weights only"):
        parse_recipe("params=fp16,compute=fp16,rounding=kahan,scale=dynamic")
    with pytest.raises(ValueError, match="rounding=kahan"):             # offered as a fix
        parse_recipe("params=bf16")
    with pytest.raises(ValueError, match="bf16-kahan .* not supported under FSDP2.*bf16-pure"):
        _check_fsdp_recipe(nn.Linear(2, 2), r)


class _TinyLM(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb, self.ln = nn.Embedding(vocab, d), nn.LayerNorm(d)
        self.fc, self.head = nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, idx):                             # (B, T) -> (B, T, vocab)
        return self.head(F.gelu(self.fc(self.ln(self.emb(idx)))))


def _lm_run(compiled: bool):
    torch.manual_seed(0)
    model = _TinyLM()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), "bf16-kahan",
                        clip_grad_norm=1.0)
    fwd = model
    if compiled:
        torch._dynamo.reset()
        mp.compile_step(backend="aot_eager")
        fwd = torch.compile(model, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)
    losses, skipped = [], []
    for step in range(5):
        with mp.autocast():
            loss = F.cross_entropy(fwd(idx).flatten(0, 1), tgt.flatten())
        mp.backward(loss * (math.inf if step == 2 else 1.0))
        skipped.append(mp.step().skipped)
        mp.zero_grad()
        losses.append(loss.item())
    return losses, skipped, mp


@pytest.mark.slow     # two aot_eager compiles: ~6 s on 2 cores
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_model_and_step_train_as_eager():
    # As bf16-sr: the whole model traces (fullgraph) and the compiled step skips on the device.
    eager, e_skip, e_mp = _lm_run(False)
    compiled, c_skip, c_mp = _lm_run(True)
    assert c_skip == e_skip == [False, False, True, False, False]
    assert compiled == pytest.approx(eager, rel=2e-3) and compiled[-1] < compiled[0]
    for a, b in zip(e_mp.master.kahan.fp32_weights(), c_mp.master.kahan.fp32_weights()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)

"""Stochastic rounding is unbiased and exact where it should be; bf16-sr keeps learning where bf16 stops,
rounds a chunk in a few passes (not per tensor), and a skipped step leaves its noise where it was."""

import math
import warnings

import pytest
import torch
from conftest import OPTIMIZERS, batches, tiny_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import MixedPrecision
from mixprec.update.master import MasterWeights
from mixprec.update.stochastic_rounding import RoundingNoise, stochastic_round_bf16, stochastic_round_bf16_
from mixprec.recipe import Rounding


@pytest.mark.parametrize("value, frac_up", [(1 + 2**-10, 1 / 8), (-(1 + 3 * 2**-9), 3 / 4), (3e-3, None)])
def test_stochastic_rounding_is_unbiased(value, frac_up):
    n = 200_000
    x = torch.full((n,), value)
    out = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    # The two bf16 neighbours: the fp32 pattern with its low 16 bits cleared, and one bf16 ulp further out.
    bits = torch.tensor([value]).view(torch.int32) & -65536
    lo, hi = bits.view(torch.float32).item(), (bits + 65536).view(torch.float32).item()
    assert set(out.unique().tolist()) <= {lo, hi}
    # The mean lands within 5 standard errors of the true value: unbiased, measured statistically.
    sigma = abs(hi - lo) * math.sqrt(0.25 / n)
    assert abs(out.double().mean().item() - value) < 5 * sigma
    if frac_up is not None:
        assert abs((out != lo).double().mean().item() - frac_up) < 5 * math.sqrt(frac_up * (1 - frac_up) / n)


def test_stochastic_rounding_leaves_representable_values_and_specials_alone():
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, math.inf, -math.inf, math.nan]).bfloat16().float()
    out = stochastic_round_bf16(x, torch.Generator().manual_seed(1)).float()
    assert torch.equal(out[:-1].view(torch.int32), x[:-1].view(torch.int32)) and out[-1].isnan()


def test_bf16_sr_keeps_learning_where_nearest_rounding_stops():
    # Updates of 1e-3 against |w| = 1 are below half a bf16 ulp (2**-8): round-to-nearest drops every
    # one. Stochastic rounding applies them on average.
    final = {}
    for recipe in ("params=bf16,compute=bf16,master=none", "bf16-sr"):
        model = nn.Linear(256, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), recipe)
        for _ in range(100):
            with mp.autocast():
                loss = model(torch.ones(1, 256)).sum()    # every weight's gradient is 1
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
        final[recipe] = model.weight.float().mean().item()
    assert final["params=bf16,compute=bf16,master=none"] == 1.0
    assert abs(final["bf16-sr"] - 0.9) < 0.01        # 1 - 100 * 1e-3, up to rounding noise


def test_bf16_sr_holds_no_fp32_copy_between_steps():
    model = nn.Linear(64, 64)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-sr")
    with mp.autocast():
        mp.backward(model(torch.randn(4, 64)).square().mean())
    mp.step()
    assert all(m.numel() == 0 for m in mp.master.masters)
    state = mp.optimizer.state[mp.master.masters[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == (64, 64)


# --------------------------------------------------------------------------------------------------
# The chunked stochastic rounding MasterWeights does (bf16-sr): one flat buffer per chunk, its noise
# from RoundingNoise (two small hashed tables, T[g % M] ^ U[g // M]), not a generator draw per element.
# The stream differs from the per-tensor torch.randint one it replaced (one table pair per step instead
# of one draw per element): no test pins either stream's values, only their properties, below.


def _bits(values) -> torch.Tensor:
    """fp32 tensor from int32 bit patterns (given as unsigned 32-bit ints)."""
    return torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32).view(torch.float32)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each fp32 value's bf16 neighbours as int16 patterns: low bits cleared, and one pattern further out."""
    hi = x.view(torch.int32) >> 16
    return hi.to(torch.int16), (hi + 1).to(torch.int16)


@pytest.mark.parametrize("value", [1 + 2**-10, -(1 + 3 * 2**-9), 3e-3])
def test_chunk_rounding_is_unbiased_and_its_noise_pairwise_independent(value):
    # 4096 copies of one value, rounded in 400 steps. Unbiased: the share rounded up (away from zero)
    # is the dropped fraction of an ulp. Pairwise independent noise: the count rounded up in one step
    # scatters as a binomial (noise repeated along a row or column of the tables would scatter wider).
    n, steps = 4096, 400
    noise = RoundingNoise(seed=5, numel=n, device="cpu")
    assert (noise.width, noise.rows) == (64, 64)
    lo, hi = _neighbours(torch.tensor([value]))
    lo_value, hi_value = (_bits([(int(b) & 0xFFFF) << 16]).item() for b in (lo, hi))
    p = (value - lo_value) / (hi_value - lo_value)
    ups, per_element = [], torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        scratch = torch.empty(n, dtype=torch.int32)
        noise.fill_(scratch, 0, noise.tables())
        noise.advance()
        out = stochastic_round_bf16_(torch.full((n,), value), scratch).view(torch.int16)
        assert bool(((out == lo) | (out == hi)).all())
        ups.append(int((out == hi).sum()))
        per_element += (out == hi).double()
    counts = torch.tensor(ups, dtype=torch.float64)
    assert abs(counts.mean().item() / n - p) < 5 * math.sqrt(p * (1 - p) / (n * steps))
    # The variance of 400 binomial counts has a relative standard error of sqrt(2 / 399) ~ 7%.
    assert 0.65 < counts.var().item() / (n * p * (1 - p)) < 1.4
    # And from step to step: each element's count over the 400 steps scatters as a binomial too
    # (over 4096 elements: relative standard error ~2%), so its rounding errors do not pile up.
    assert 0.85 < per_element.var().item() / (steps * p * (1 - p)) < 1.15


def _alone(noise: RoundingNoise) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's tables hashed alone, as a traced step hashes them (the batch's reference)."""
    return noise._split(noise._hashed(noise.rounds))


def test_tables_hashed_ahead_are_those_hashed_alone_through_skips_batches_and_a_reload():
    # Eager steps pick their tables from a batch hashed for the next 64 step counts (2 ops a step,
    # not ~25). Every step's pick must equal that step's tables hashed alone: through skipped steps
    # (rounds stays, the same row again), past the batch's end (rehashed after 64 advances), across a
    # set_state (a resumed run: the batch is dropped) and after a traced advance the object cannot count.
    noise = RoundingNoise(seed=11, numel=19_209, device="cpu")
    assert noise._ahead == 64
    skips = torch.Generator().manual_seed(0)
    traced_advance = torch.compile(noise.advance, backend="eager", fullgraph=True)
    for step in range(260):
        picked = noise.tables()
        assert all(torch.equal(a, b) for a, b in zip(picked, _alone(noise))), step
        if step == 90:      # a resume elsewhere in the stream
            noise.set_state(torch.tensor([11, 0, 5000], dtype=torch.int64))
        elif 150 <= step < 150 + 64:   # advanced inside a graph, a whole batch's worth, uncounted
            traced_advance(torch.tensor(False))
        else:
            noise.advance(torch.rand((), generator=skips) < 0.3)
    assert noise._batch is not None and 5000 + 64 < int(noise.rounds) < 5000 + 170


def test_a_model_too_large_to_batch_hashes_each_step_alone():
    # Tables of 2**18 entries or more: no batch is held (its memory would buy nothing at that size).
    noise = RoundingNoise(seed=1, numel=2**34, device="meta")
    assert noise._ahead < 2


def test_seeds_give_unrelated_noise():
    # Seeds 0 and 1 (and one past 2**32) share no stretch of noise, shifted or not: about 1 equal
    # value in 65536 is chance.
    n = 4096
    streams = []
    for seed in (0, 1, 2**32):
        noise = RoundingNoise(seed=seed, numel=n, device="cpu")
        out = torch.empty(n, dtype=torch.int32)
        noise.fill_(out, 0, noise.tables())
        streams.append(out)
    for a in streams:
        for b in streams:
            if a is not b:
                for shift in range(3):
                    assert int((a[shift:] == b[:n - shift]).sum()) < 5


def test_chunk_rounding_keeps_specials_and_rounds_only_to_neighbours():
    values = [0x00000000, 0x80000000, 0x3F800000, 0xC0200000,        # +-0, 1, -2.5: bf16 already
              0x7F7F0000, 0xFF7F0000,                                # +-largest finite bf16
              0x7F7FFFFF, 0xFF7F8001,                                # above it: to it, or to +-inf
              0x00000001, 0x8000FFFF, 0x00017FFF,                    # subnormals
              0x7F800000, 0xFF800000]                                # +-inf
    nans = [0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF80FFFF]
    x = _bits(values + nans)
    finite = slice(0, len(values))
    lo, hi = (b[finite] for b in _neighbours(x))
    exact = ((x.view(torch.int32) & 0xFFFF) == 0)[finite]
    for fill in (0, 0xFFFF, None):      # no noise, the largest noise, random noise
        scratch = torch.full((len(x),), fill, dtype=torch.int32) if fill is not None else \
            torch.randint(0, 1 << 16, (len(x),), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
        out = stochastic_round_bf16_(x.clone(), scratch)
        bits = out.contiguous().view(torch.int16)[finite]
        assert bool(((bits == lo) | (bits == hi)).all())     # the pattern below, or the next one up
        assert bool((bits[exact] == lo[exact]).all())         # representable: kept, whatever the noise
        assert bool(out[len(values):].isnan().all())          # NaN stays NaN, whatever its payload
    # Above bf16's largest finite value the next pattern up is inf, as stochastic_round_bf16 has it.
    above = stochastic_round_bf16_(_bits([0x7F7FFFFF]), torch.tensor([1], dtype=torch.int32))
    assert above.float().item() == math.inf
    assert stochastic_round_bf16(_bits([0x7F7FFFFF] * 64), torch.Generator().manual_seed(0)).float().isinf().any()


def _ops_in(fn) -> list[str]:
    """The aten ops ``fn`` dispatches that touch data (views, which only describe it, left out)."""
    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return ops


def test_transient_copies_are_filled_and_rounded_per_chunk_not_per_tensor():
    # The ops that read or write data do not grow with the number of tensors: 2 layers or 12.
    counts = []
    for layers in (2, 12):
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        mw = MasterWeights(list(model.parameters()), opt, keep=False, rounding=Rounding.STOCHASTIC)
        model.bfloat16()
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        pulled = _ops_in(mw.pull_grads)
        opt.step()
        pushed = _ops_in(mw.push_weights)
        counts.append((len(pulled), len(pushed)))
        assert all(m.numel() == 0 for m in mw.masters)
    assert counts[0] == counts[1], counts


def _fused_run(grads, skipped_at=None):
    """bf16-sr copies of a tiny model stepped by fused AdamW on the given bf16 gradients; at
    ``skipped_at`` the kernel is handed found_inf = 1, as the engine's device-decided path does."""
    model = tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mw = MasterWeights(list(model.parameters()), opt, keep=False, rounding=Rounding.STOCHASTIC, seed=7)
    model.bfloat16()
    for step, step_grads in enumerate(grads):
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        opt.grad_scale, opt.found_inf = None, torch.tensor(float(step == skipped_at))
        mw.step(opt, opt.step)
        del opt.grad_scale, opt.found_inf
    return model, opt, mw


def test_a_step_skipped_in_the_fused_kernel_leaves_the_rounding_noise_where_it_was():
    # issue 24 item 8: the skip is decided on the device (no host sync), so push_weights still runs;
    # the rounds counter advances by 1 - found_inf there, and the run goes on exactly as one that
    # never saw the bad step.
    g = torch.Generator().manual_seed(3)
    shapes = [p.shape for p in tiny_model().parameters()]
    grads = [[(torch.randn(s, generator=g) * 0.1).bfloat16() for s in shapes] for _ in range(4)]
    bad = [torch.full(s, 1e30).bfloat16() for s in shapes]
    twin, twin_opt, twin_mw = _fused_run(grads)
    model, opt, mw = _fused_run(grads[:2] + [bad] + grads[2:], skipped_at=2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(opt.state_dict()["state"].values(), twin_opt.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert int(mw.generator.rounds) == int(twin_mw.generator.rounds) == 4


def test_a_skipped_step_in_the_engine_leaves_later_steps_as_if_never_seen():
    # The same through MixedPrecision, on whichever path it skips (host- or device-decided).
    def run(plant):
        model = tiny_model(seed=0)
        mp = MixedPrecision(model, OPTIMIZERS["adamw-fused"](model.parameters()), "bf16-sr", seed=4)
        data = batches(5, seed=1)
        for step, (x, y) in enumerate(data):
            if step == 2 and not plant:
                continue                     # the twin never sees the bad batch
            with mp.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            mp.backward(loss)
            if step == 2:
                next(model.parameters()).grad.view(-1)[0] = math.inf
            assert mp.step().skipped == (step == 2)
            mp.zero_grad()
        return model, mp
    (a, mp_a), (b, mp_b) = run(True), run(False)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    assert int(mp_a.master.generator.rounds) == int(mp_b.master.generator.rounds) == 4


def test_the_noise_follows_the_weights_not_the_chunk_layout():
    # The noise of an element is a function of its place in the order the optimizer held at
    # construction: reordering the groups later changes the layout of every chunk, not one rounding.
    results = []
    for reverse in (False, True):
        model = tiny_model(seed=0)
        decay = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2,
                                foreach=True)
        mp = MixedPrecision(model, opt, "bf16-sr", seed=1)
        if reverse:
            opt.param_groups.reverse()
        for x, y in batches(3, seed=2):
            with mp.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bad_seed_and_old_rounding_state_are_refused_with_the_fix():
    model = tiny_model()
    with pytest.raises(ValueError, match="seed must be an int"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-sr", seed="abc")
    model = tiny_model()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-sr")
    state = mp.master.state_dict()
    assert state["generator"].dtype == torch.int64 and state["generator"].shape == (3,)
    old = dict(state, generator=torch.Generator().get_state())       # the mt19937 state saved before
    with pytest.raises(ValueError, match="older mixprec"):
        mp.master.load_state_dict(old)
    mp.master.load_state_dict(state)


# ----------------------------------------------------- a change the user makes is the truth (issue 33)
def _one_step(mp, seed=9):
    x, y = batches(1, seed=seed)[0]
    with mp.autocast():
        loss = torch.nn.functional.cross_entropy(mp.model(x), y)
    mp.backward(loss)
    result = mp.step()
    mp.zero_grad()
    return result


def _fp32_of(mp) -> list[torch.Tensor]:
    return mp.master.kahan.fp32_weights() if mp.master.kahan is not None else [m.detach() for m in mp.master.masters]


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure", "bf16-kahan"])
@pytest.mark.parametrize("how", ["load_state_dict", "no_grad_edit", "reinit"])
def test_a_weight_the_user_changes_after_the_engine_is_taken_as_the_truth(recipe, how):
    # Before issue 33 the next step rounded the old fp32 masters back over the user's values (pure),
    # or joined the new bf16 weight with the old compensation (kahan).
    model = tiny_model(seed=0)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)   # lr 0: no update
    _one_step(mp)
    weight = model[0].weight
    new = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)).to(weight.dtype)
    if how == "load_state_dict":
        sd = model.state_dict()
        sd["0.weight"] = new
        model.load_state_dict(sd)
    elif how == "no_grad_edit":
        with torch.no_grad():
            weight.copy_(new)
    else:
        torch.manual_seed(7)
        model[0].reset_parameters()          # init writes in place under no_grad: the counter moves
        new = weight.detach().clone()
    with pytest.warns(UserWarning, match="changed since the engine last wrote"):
        _one_step(mp)
    assert torch.equal(weight.detach(), new)                   # not undone by the step (lr 0)
    assert torch.equal(_fp32_of(mp)[0], new.float())           # the fp32 value is the user's, exactly
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # said once per engine
        with torch.no_grad():
            weight.mul_(2)
        _one_step(mp)
    assert torch.equal(weight.detach(), (new.float() * 2).to(weight.dtype))


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure"])
def test_a_weight_swapped_out_and_back_keeps_its_fp32_master_bits(recipe):
    # EMA swap: weights swapped in for evaluation, then the training weights back: where the weight is
    # again the master's rounding the master keeps its fp32 bits; nothing else moves.
    model = tiny_model(seed=0)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    for seed in range(3):
        _one_step(mp, seed)
    before = [m.detach().clone() for m in mp.master.masters]
    saved = [p.detach().clone() for p in mp.master.model_params]
    with torch.no_grad():
        for p in mp.master.model_params:
            p.mul_(0.5)                        # "EMA" weights in
        for p, s in zip(mp.master.model_params, saved):
            p.copy_(s)                         # training weights back
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # nothing moved in the end: no note
        state = mp.state_dict()                # reading the state adopts changes too
    assert all(torch.equal(a, b) for a, b in zip(before, state["master"]["masters"]))
    assert any((m != m.to(p.dtype).float()).any() for m, p in zip(before, saved))   # bits a 16-bit copy lacks


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure", "bf16-kahan"])
def test_load_model_state_dict_loads_fp32_weights_at_fp32_precision(recipe):
    source = tiny_model(seed=3)
    with torch.no_grad():
        source[0].weight.add_(1e-4)           # bits below a 16-bit ulp
    sd = source.state_dict()
    model = tiny_model(seed=0)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # no note: the engine loaded them itself
        mp.load_model_state_dict(sd)
        _one_step(mp)
    fp32 = mp.fp32_state_dict()
    assert all(torch.equal(fp32[k], v) for k, v in sd.items())
    low = model[0].weight
    rounding = sd["0.weight"].to(low.dtype)
    if recipe == "bf16-kahan":                 # ties away from zero, not to even (update/kahan.py)
        assert (low.float() - sd["0.weight"]).abs().le(low.float().abs() * 2**-8).all()
    else:
        assert torch.equal(low.detach(), rounding)
    # model.load_state_dict instead: the masters start from the 16-bit rounding (the documented cost).
    model2 = tiny_model(seed=0)
    mp2 = MixedPrecision(model2, torch.optim.SGD(model2.parameters(), lr=0.0), recipe)
    model2.load_state_dict(sd)
    with pytest.warns(UserWarning, match="load_model_state_dict"):
        _one_step(mp2)
    assert not torch.equal(mp2.fp32_state_dict()["0.weight"], sd["0.weight"])


def test_a_checkpoint_load_is_not_taken_for_a_user_change(tmp_path):
    from mixprec import load_checkpoint, save_checkpoint
    model = tiny_model(seed=0)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "fp16-pure")
    for seed in range(3):
        _one_step(mp, seed)
    path = save_checkpoint(tmp_path / "ck.pt", mp)
    model2 = tiny_model(seed=1)
    mp2 = MixedPrecision(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), "fp16-pure")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint(path, mp2)             # the model first, then its masters: no user change
        _one_step(mp2)
    _one_step(mp)
    assert all(torch.equal(a, b) for a, b in zip(mp.master.masters, mp2.master.masters))

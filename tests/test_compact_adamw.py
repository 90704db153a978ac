"""The engine's own AdamW with compact moments: torch's update bit for bit in fp32, unbiased stochastic
rounding where round-to-nearest freezes Adam's second moment, fp8 blocks on their grid, skips and
checkpoints that change nothing, and the bytes memory_report predicts."""

import dataclasses
import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import batches, tiny_model
from torch import nn

from mixprec import MixedPrecision, memory_report, parse_recipe
from mixprec.checkpoint.files import load_checkpoint, save_checkpoint
from mixprec.update.compact_adamw import CompactAdamW, decode_moment, encode_moment, moment_bytes
from mixprec.recipe.moments import Moments


def two_groups(params, cls, lr=1e-2):
    params = list(params)
    return cls([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
               lr=lr, betas=(0.9, 0.99), foreach=False)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fp32_moments_are_torchs_single_tensor_adam_bit_for_bit(cls):
    ours, ref = tiny_model(seed=1), tiny_model(seed=1)
    opt_ours, opt_ref = two_groups(ours.parameters(), cls), two_groups(ref.parameters(), cls)
    adam = CompactAdamW(opt_ours, Moments.FP32)
    for step, (x, y) in enumerate(batches(6)):
        if step == 3:     # an LR schedule: read from the user's optimizer every step
            for g in opt_ours.param_groups + opt_ref.param_groups:
                g["lr"] = 3e-3
        for model in (ours, ref):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
        adam.step()
        opt_ref.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert not opt_ours.state         # the user's optimizer never stepped


def test_stochastic_rounding_keeps_the_second_moment_that_round_to_nearest_freezes():
    # g = 1 every step, lr = 0: v_t = 1 - 0.999**t exactly. Each step adds 0.1% of (1 - v), below half
    # a bf16 ulp of v (2**-9 relative) once v > ~0.3: round-to-nearest stops there.
    t, n = 1000, 4096
    exact = 1 - 0.999 ** t                                   # 0.632
    got = {}
    for fmt in (Moments.BF16, Moments.BF16_SR):
        w = nn.Parameter(torch.zeros(n))
        adam = CompactAdamW(torch.optim.Adam([w], lr=0.0, betas=(0.9, 0.999)), fmt, seed=0)
        for _ in range(t):
            w.grad = torch.ones(n)
            adam.step()
        got[fmt] = decode_moment(adam.state[w]["exp_avg_sq"], fmt, w).mean().item()
    assert adam.state[w]["exp_avg_sq"].dtype == torch.bfloat16
    # Nearest: at v = 0.25 the step is 0.25 * 0.999 + 0.001 = 0.25075, which rounds back to 0.25 (bf16's
    # ulp there is 2**-9 = 0.00195): frozen at exactly 0.25. Just below 0.25 the ulp halves and it moves.
    assert got[Moments.BF16] == 0.25
    # SR: each element a sum of ~1000 unbiased roundings; the mean over 4096 elements is within 0.2%.
    assert got[Moments.BF16_SR] == pytest.approx(exact, rel=2e-3)


def test_fp8_blocks_hold_grid_values_exactly_and_round_others_unbiased():
    gen = torch.Generator().manual_seed(0)
    # Values on the e4m3 grid of their block's scale: a block with max 448 * 2**-4 has scale 2**-4.
    on_grid = torch.tensor([448.0, 1.0, -0.5, 0.125, 2.0 ** -9, 0.0] * 2) * 2.0 ** -4   # one padded block
    codes, inv_scale = encode_moment(on_grid, Moments.FP8, gen)
    assert codes.dtype == torch.float8_e4m3fn and codes.numel() == 128 and inv_scale.tolist() == [2.0 ** -4]
    assert torch.equal(decode_moment((codes, inv_scale), Moments.FP8, on_grid), on_grid)
    assert moment_bytes(Moments.FP8, 12) == 128 + 4 and moment_bytes(Moments.FP8, 256) == 256 + 8
    # Between grid points: 1 + 0.3 * 2**-3 lies 30% of an ulp (2**-3 at 1) above 1, in blocks whose
    # first element is 448 (scale 1): it rounds up w.p. 0.3.
    def blocks_of(value):
        x = torch.full((64, 128), value)
        x[:, 0] = 448.0
        decoded = decode_moment(encode_moment(x, Moments.FP8, gen), Moments.FP8, x)
        return decoded[:, 1:]
    decoded = blocks_of(1.0 + 0.3 * 2.0 ** -3)
    assert set(decoded.unique().tolist()) == {1.0, 1.125}
    assert (decoded == 1.125).float().mean().item() == pytest.approx(0.3, abs=0.03)
    # The fine grid below 2**-6 (steps of 2**-9): 0.4 of a step rounds up w.p. 0.4, to 0 otherwise.
    decoded = blocks_of(0.4 * 2.0 ** -9)
    assert set(decoded.unique().tolist()) == {0.0, 2.0 ** -9}
    assert decoded.mean().item() == pytest.approx(0.4 * 2.0 ** -9, rel=0.05)


RECIPES = ["bf16-sr,moments=bf16-sr", "bf16-sr,moments=fp8", "fp16-pure,moments=bf16-sr",
           "bf16,moments=bf16", "params=fp32,compute=fp32,moments=fp8"]


def train(recipe, steps, seed=0, plant_at=None, mp=None, start=0, fixed=False):
    if mp is None:
        model = tiny_model(seed=seed)
        mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe, seed=seed,
                            clip_grad_norm=1.0)
    losses = []
    data = batches(1, seed=seed + 1) * steps if fixed else batches(start + steps, seed=seed + 1)[start:]
    for step, (x, y) in enumerate(data, start=start):
        with mp.autocast():
            loss = F.cross_entropy(mp.model(x), y)
        mp.backward(loss)
        if step == plant_at:
            mp.model[0].weight.grad.view(-1)[3] = math.nan
        mp.step()
        mp.zero_grad()
        losses.append(loss.item())
    return mp, losses


def engine_state(mp, counters=False):
    state = copy.deepcopy(mp.state_dict())
    if not counters:          # the loss scale counts steps, skipped ones too
        del state["loss_scale"]
    return copy.deepcopy(mp.model.state_dict()), state


def assert_equal_states(a, b):
    def flat(x):
        return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]
    for t, u in zip(flat(a), flat(b), strict=True):
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           u.view(torch.uint8) if u.dtype == torch.float8_e4m3fn else u)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_skipped_step_changes_nothing_and_training_still_learns(recipe):
    mp, losses = train(recipe, 3)
    before = engine_state(mp)
    train(recipe, 1, plant_at=3, mp=mp, start=3)
    assert mp.skipped_steps == 1
    assert_equal_states(before, engine_state(mp))
    _, losses = train(recipe, 40, fixed=True)          # one batch, learnt by heart
    _, fp32_losses = train("fp32", 40, fixed=True)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert sum(losses[-5:]) == pytest.approx(sum(fp32_losses[-5:]), rel=0.15)


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_from_a_checkpoint_continues_bit_for_bit(recipe, tmp_path):
    straight, _ = train(recipe, 6)
    first, _ = train(recipe, 3)
    path = save_checkpoint(tmp_path / "c.ckpt", first)
    model = tiny_model(seed=0)
    resumed = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe, seed=0,
                             clip_grad_norm=1.0)
    load_checkpoint(path, resumed)
    state = pickle.loads(pickle.dumps(resumed.state_dict()))
    resumed.load_state_dict(state)              # the engine state alone round-trips too
    train(recipe, 3, mp=resumed, start=3)
    assert_equal_states(engine_state(straight, counters=True), engine_state(resumed, counters=True))


def test_memory_is_8_bytes_per_parameter_with_bf16_sr_weights_and_bf16_moments():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-3)   # noqa: E731
    expect = {"bf16-sr,moments=bf16-sr": 8.0, "bf16-sr": 12.0, "fp16-pure,moments=bf16-sr": 12.0,
              "bf16-pure": 16.0, "fp16-pure": 16.0}
    for recipe, b_per_param in expect.items():
        r = memory_report(mlp, recipe, batch, optimizer=adamw, loss_fn=F.cross_entropy, measure=True)
        # peak: predicted always, measured only by the CUDA allocator (None on the CPU).
        assert r.measured == dataclasses.replace(r.predicted, peak=None), recipe
        # Step counters: torch keeps an fp32 tensor per parameter tensor (4 x 4 B); ours are ints.
        counters = 0 if "moments" in recipe else 16
        assert r.bytes_per_param * r.n_params == b_per_param * r.n_params + counters, recipe
    fp8 = memory_report(mlp, "bf16-sr,moments=fp8", batch, optimizer=adamw, loss_fn=F.cross_entropy)
    # 64x256 + 256 + 256x10 + 10 elements, two moments each in blocks of 128 (1 B) + 4 B per block.
    blocks = [128, 2, 20, 1]
    assert fp8.predicted.optimizer == 2 * sum(b * 128 + 4 * b for b in blocks)


def test_any_int_seeds_the_compact_moments_noise_modulo_2_64():
    # 2**70 and 2**64 - 1 + 1 failed inside torch.Generator.manual_seed ("Overflow when unpacking long long");
    # the seed is taken modulo 2**64, as the stochastic rounding's is.
    recipe = "bf16,moments=bf16-sr"
    for seed, alias in ((2**70, 2**70 % 2**64), (-1, 2**64 - 1)):
        a = train(recipe, 2, mp=_engine(recipe, seed))[0]
        b = train(recipe, 2, mp=_engine(recipe, alias))[0]
        assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def _engine(recipe, seed):
    model = tiny_model()
    return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe, seed=seed,
                          clip_grad_norm=1.0)


def test_bad_input_names_the_fix():
    model = tiny_model()
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16,moments=bf16-sr")
    with pytest.raises(ValueError, match="amsgrad=True"):
        MixedPrecision(model, torch.optim.Adam(model.parameters(), amsgrad=True), "bf16,moments=bf16-sr")
    with pytest.raises(ValueError, match="unknown moments 'fp4'; valid values: fp32, bf16, bf16-sr, fp8"):
        parse_recipe("bf16,moments=fp4")
    mp, _ = train("bf16-sr,moments=bf16-sr", 1)
    state = mp.state_dict()
    state["moments"]["format"] = "fp8"
    with pytest.raises(ValueError, match="moments=fp8, this engine runs moments=bf16-sr"):
        mp.load_state_dict(state)
    assert str(parse_recipe("bf16-sr,moments=bf16-sr")).endswith(",moments=bf16-sr")

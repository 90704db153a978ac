"""Pure recipes at 16 B/param: no fp32 gradient outlives a step (a small model's kept buffer aside), the
step's fp32 transients stay within one chunk, and a chunked step is the unchunked step bit for bit (skips
included), as a step through a small model's kept buffer is one through fresh memory."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import OPTIMIZERS, assert_same_state, batches, master_state, tiny_model

import mixprec.update.transients as transients_module
from mixprec import MixedPrecision
from mixprec.diagnostics.memory import state_bytes, storage_bytes
from mixprec.update.master import MasterWeights


def train(recipe, opt_name, chunk_bytes=None, steps=4, clip=None, plant_at=None, seed=0):
    model = tiny_model(seed=seed)
    mp = MixedPrecision(model, OPTIMIZERS[opt_name](model.parameters()), recipe, clip_grad_norm=clip, seed=3)
    if chunk_bytes is not None:
        mp.master.chunk_bytes = chunk_bytes
    skipped = []
    for step, (x, y) in enumerate(batches(steps, seed=seed + 1)):
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        if step == plant_at:
            model[0].weight.grad.view(-1)[5] = math.inf
        skipped.append(mp.step().skipped)
        mp.zero_grad()
    return mp, skipped


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure", "bf16-sr",
                                    "params=fp16,compute=fp16,master=fp32,scale=static:1024"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_a_chunked_step_is_the_one_call_step_bit_for_bit(recipe, opt_name):
    # 100 bytes: every weight matrix (8x16 and 16x4 elements, 4 or 8 B each) is a chunk of its own.
    whole, _ = train(recipe, opt_name, clip=1.0, plant_at=1)
    chunked, skipped = train(recipe, opt_name, chunk_bytes=100, clip=1.0, plant_at=1)
    assert skipped[1] and not any(skipped[2:])
    assert_same_state(master_state(whole), master_state(chunked))


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-sr"])
@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd-momentum"])
def test_fp32_transients_stay_within_one_chunk_and_none_outlive_the_step(recipe, opt_name):
    model = tiny_model(hidden=64)
    mp = MixedPrecision(model, OPTIMIZERS[opt_name](model.parameters()), recipe)
    mp.master.chunk_bytes = 1024
    seen = []

    def count(optimizer, args, kwargs):   # an optimizer step pre-hook: once per chunk
        alive = [m.grad for m in mp.master.masters] + [m for m in mp.master.masters if not mp.master.keep]
        seen.append(storage_bytes(alive))

    mp.optimizer.register_step_pre_hook(count)
    for x, y in batches(2, d_in=8):
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.step()
        held = state_bytes(mp)
        # After the step: only the model's 16-bit gradients; the copies' gradients are gone.
        assert all(m.grad is None for m in mp.master.masters)
        assert held.grads == storage_bytes([p.grad for p in model.parameters()])
        mp.zero_grad()
    # Chunks of <= 1024 B: [w0 64x8] (larger than a chunk: alone), [b0 64, the fp32 norm (no transient)],
    # [w1 4x64], [b1 4], in elements of fp32 transients per chunk:
    chunks = (512, 64, 256, 4)
    if mp.master.keep:
        # fp16-pure on the CPU: every chunk is cast into one workspace kept between steps and sized for
        # the largest chunk (w0: 512 x 4 B), so that is what is alive at each chunk, and all that stays.
        assert seen == [4 * max(chunks)] * 8 and mp.master.workspace_bytes == 4 * max(chunks)
    else:
        # bf16-sr: per element 8 B (the fp32 gradient and the transient fp32 weight) in one buffer that
        # every chunk of a step reuses, sized for the largest chunk (w0), and freed when the step ends:
        # nothing is kept and the copies are empty again.
        assert seen == [8 * max(chunks)] * 8 and mp.master.workspace_bytes == 0
        assert all(m.numel() == 0 for m in mp.master.masters)


def test_bad_chunk_size_names_the_fix():
    model = tiny_model()
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        MasterWeights(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1), keep=True,
                      chunk_bytes=0)


class _Watch:
    """A step observer that reads nothing: with one the copies are filled whole (pull_grads/push_weights)."""

    def before_step(self, engine):
        pass

    def after_step(self, engine, found_inf):
        pass


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure", "bf16-sr", "bf16-kahan"])
@pytest.mark.parametrize("opt_name", ["adamw-fused", "sgd-momentum"])
@pytest.mark.parametrize("whole", [False, True], ids=["chunked", "whole"])
def test_a_small_models_kept_transients_step_bitwise_as_fresh_ones(recipe, opt_name, whole, monkeypatch):
    # A small model keeps its step's fp32 transients and their views (4 B/param with a master copy, 8
    # without) and fills the same memory every step, in the chunk-by-chunk step and where the copies
    # are filled whole (an observer, a compiled step). That changes no number: six steps, with an
    # overflow planted at step 1 and a gradient missing at step 3 (laid out afresh that step), equal
    # the same run with nothing kept (_SMALL_KEPT = 0), bit for bit, losses and skips included.
    def run():
        model = tiny_model()
        mp = MixedPrecision(model, OPTIMIZERS[opt_name](model.parameters()), recipe, seed=3)
        if whole:
            mp.add_step_observer(_Watch())
        seen, losses, skipped = [], [], []
        mp.optimizer.register_step_pre_hook(lambda *_: seen.append(
            [None if m.grad is None else m.grad.data_ptr() for m in mp.master.masters]))
        for step, (x, y) in enumerate(batches(6)):
            with mp.autocast():
                loss = F.cross_entropy(model(x), y)
            mp.backward(loss)
            if step == 1:
                model[0].weight.grad.view(-1)[5] = math.inf
            if step == 3:
                model[3].bias.grad = None
            skipped.append(mp.step().skipped)
            losses.append(loss.item())
            mp.zero_grad()
            assert all(m.grad is None for m in mp.master.masters)   # no fp32 gradient outlives the step
        return mp, seen, losses, skipped

    kept, seen, losses, skipped = run()
    low = sum(p.numel() for p in kept.master.model_params)
    assert kept.master.workspace_bytes == (4 if kept.master.keep else 8) * low
    assert skipped == [False, True, False, False, False, False]
    # The same addresses at every step taken with every gradient (seen: steps 0, 2, 3, 4, 5; step 3
    # lacked one and laid out afresh).
    assert len({tuple(ptrs) for i, ptrs in enumerate(seen) if i != 2}) == 1
    monkeypatch.setattr(transients_module, "_SMALL_KEPT", 0)
    fresh, _, fresh_losses, fresh_skipped = run()
    assert fresh.master.workspace_bytes == 0
    assert (losses, skipped) == (fresh_losses, fresh_skipped)
    assert_same_state(master_state(kept), master_state(fresh))


@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-kahan"])
def test_kept_bit_views_and_noise_xors_round_as_fresh_ones_past_the_tables_rehash(recipe, monkeypatch):
    # The kept layout also keeps its weight half's bit views and, for bf16-sr, the noise's xors into
    # its scratch, which read the two tables the noise writes its row into at every eager step. 70
    # steps cross the rehash of the batch of tables (every 64 advances) and a skip at step 40 (the
    # same row again): the weights and state equal the run that lays everything out afresh.
    def run():
        model = tiny_model()
        mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), recipe, seed=5)
        for step, (x, y) in enumerate(batches(70, seed=4)):
            with mp.autocast():
                loss = F.cross_entropy(model(x), y)
            mp.backward(loss)
            if step == 40:
                model[0].weight.grad.view(-1)[3] = math.nan
            assert mp.step().skipped == (step == 40)
            mp.zero_grad()
        return mp

    kept = run()
    assert kept.master._layout is not None and (recipe != "bf16-sr" or kept.master._noise_plan is not None)
    monkeypatch.setattr(transients_module, "_SMALL_KEPT", 0)
    fresh = run()
    assert fresh.master._layout is None
    assert_same_state(master_state(kept), master_state(fresh))


def test_kept_gradient_bytes_fit_4_mib():
    assert transients_module.kept_gradient_bytes(2**20, keep=True) == 4 * 2**20       # 4 MiB: kept
    assert transients_module.kept_gradient_bytes(2**20 + 1, keep=True) == 0
    assert transients_module.kept_gradient_bytes(2**19, keep=False) == 8 * 2**19      # weights and gradients
    assert transients_module.kept_gradient_bytes(2**19 + 1, keep=False) == 0

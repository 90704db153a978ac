"""fp8 under FSDP2 on CPU gloo ranks: each fp8 weight shard cast to e4m3 before the all-gather.

One spawn (tests/_fp8_dist_worker.py) trains a small transformer with every linear its own FSDP
unit, once with the e4m3 all-gather and once gathering fp32 (``fp8_all_gather=False``, the layer
casting after the gather), an inf planted on rank 0 at step 2. What must hold:

- the gathered e4m3 bytes and scale of every layer are bit for bit the 1-process cast of the whole
  weight (the scale comes from the max of the shard amaxes: a max is exact in any order);
- so the two runs' weights are bit for bit equal at every step, on every rank;
- the bytes: each fp8 weight crosses the all-gather as 1 byte per element (twice a step: forward,
  and the backward's re-gather), a quarter of the fp32 gather; the gradient reduce-scatter keeps
  fp32; the scales cost ONE extra all_reduce per step (one element per fp8 layer), none after a
  skipped step (the weights did not change);
- skips in lockstep, and against the 1-process fp8 run on the whole batch a stated tolerance.

The default suite spawns 2 ranks once; the slow test spawns 4 and adds the user's own fully_shard
(the engine swapping FSDP-held linears in place), a sharded-checkpoint resume and delayed scaling.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import _fp8_dist_worker as W
from mixprec.distributed import run_processes, wrap_ddp
from mixprec.fp8.fsdp_weight import Fp8ShardWeight, fp8_gather_blocker
from mixprec.fp8.linear import Fp8Linear
from mixprec.recipe.fp8 import Fp8Config

STEPS = 4
PLANTS = {2: (0, math.inf)}
SKIPS = [False, False, True, False]


def _scenarios(resume: bool):
    out = [{"name": "on", "recipe": "fp8", "steps": STEPS, "plants": PLANTS},
           {"name": "off", "recipe": "fp8", "steps": STEPS, "fp8_all_gather": False, "plants": PLANTS},
           {"name": "gathered"}, {"name": "messages"}]
    if resume:          # the slow spawn: the user's own fully_shard, a resume, delayed scaling
        out.append({"name": "own", "recipe": "fp8", "steps": STEPS, "own": True, "plants": PLANTS})
        out.append({"name": "resume", "recipe": "fp8", "steps": STEPS, "resume_at": 3})
        # Delayed scaling: the weight's scale from its amax history (entered with the global amax).
        out += [{"name": "delayed-on", "recipe": "fp8-delayed", "steps": STEPS, "plants": PLANTS},
                {"name": "delayed-off", "recipe": "fp8-delayed", "steps": STEPS, "fp8_all_gather": False,
                 "plants": PLANTS}]
    return out


def _spawn(tmp_path_factory, world: int, resume: bool):
    out = tmp_path_factory.mktemp(f"fp8dist{world}")
    run_processes(W.worker, world, (str(out), _scenarios(resume)), backend="gloo", timeout_s=400)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _spawn(tmp_path_factory, 2, resume=False)


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _reference(recipe: str):
    mp = W.build(recipe, distributed=False)
    plants = {step: (0, value) for step, (_, value) in PLANTS.items()}
    return W.train(mp, W.global_batches(STEPS), 0, 1, plants=plants)


def _check_world(ranks, world: int) -> None:
    for r in range(world):
        assert all(ranks[r]["gathered"].values()) and len(ranks[r]["gathered"]) == 9, ranks[r]["gathered"]
        on, off = ranks[r]["on"], ranks[r]["off"]
        assert [s["skipped"] for s in on] == SKIPS and [s["skipped"] for s in off] == SKIPS
        for step, (a, b) in enumerate(zip(on, off)):
            assert a["norm"] == b["norm"] or (math.isinf(a["norm"]) and math.isinf(b["norm"]))
            assert _equal(a["params"], b["params"]), f"rank {r} step {step}: e4m3 gather != fp32 gather"
            assert _equal(a["params"], ranks[0]["on"][step]["params"]), f"rank {r} step {step}: ranks differ"


def test_e4m3_gather_is_bit_for_bit_the_whole_weight_cast_and_trains_the_same(two):
    _check_world(two, 2)


def _check_own_fully_shard(ranks, world: int) -> None:
    """fully_shard called by the user, then MixedPrecision(..., "fp8"): the engine makes the FSDP-held
    linears fp8 in place (FSDP2 keeps hooks on those very modules), their weights gathered in fp32
    and cast by each layer: bit for bit the shard_model run with fp8_all_gather=False, and the
    report says how each weight is gathered."""
    for r in range(world):
        own, off = ranks[r]["own"], ranks[r]["off"]
        assert [s["skipped"] for s in own] == SKIPS
        for a, b in zip(own, off):
            assert _equal(a["params"], b["params"])
        assert own[0]["wire"]["gathered"] == off[0]["wire"]["gathered"]
    lines = [ln for ln in ranks[0]["own:report"].splitlines() if ln.strip().startswith(("blocks", "head"))]
    assert len(lines) == 9 and all("fp8: weight all-gathered unscaled by your fully_shard" in ln for ln in lines)


def test_wire_bytes_by_dtype(two):
    model = W.tiny_lm()
    fp8_numel = W.fp8_weight_numel(model)                                  # 26,624
    rest = sum(p.numel() for p in model.parameters()) - fp8_numel           # embedding + norms: 2,368
    layers = sum(isinstance(m, nn.Linear) for m in model.modules())        # 9
    for step, (on, off) in enumerate(zip(two[0]["on"], two[0]["off"])):
        on, off = on["wire"], off["wire"]
        # Every linear is its own unit: its buffer holds its e4m3 bytes only (sent as uint8), gathered
        # for the forward and again for the backward. The root (embedding, norms) gathers fp32 once.
        assert on["gathered"] == {"torch.uint8": 2 * fp8_numel, "torch.float32": 4 * rest}
        assert off["gathered"] == {"torch.float32": 2 * 4 * fp8_numel + 4 * rest}
        # The gradient reduce-scatter is untouched: fp32, every parameter once.
        assert on["scattered"] == off["scattered"] == {"torch.float32": 4 * (fp8_numel + rest)}
        # One all_reduce of the 9 shard amaxes together, then the engine's norm; none after the skip.
        assert off["all_reduces"] == [1]
        assert on["all_reduces"] == ([1] if step == 3 else [layers, 1]), step


@pytest.mark.slow
def test_against_one_process_on_the_whole_batch(two):
    """Not bit for bit: current scaling scales each rank's activations and output gradients by that
    rank's own amax (half the batch), so their fp8 roundings differ from the 1-process run's, and the
    gradient sums are split differently. Both are roundings of the recipe's own kind, so the 2-rank
    weights must lie no further from the 1-process fp8 run than 2x that run's distance from its bf16
    twin (the whole fp8 rounding), and skips, clipping and the weights' fp8 casts agree exactly."""
    one, twin = _reference("fp8"), _reference("bf16")
    assert [s["skipped"] for s in one] == SKIPS
    recipe_noise = max((p - q).abs().max().item() for p, q in zip(one[-1]["params"], twin[-1]["params"]))
    split_noise = max((p - q).abs().max().item() for p, q in zip(two[0]["on"][-1]["params"], one[-1]["params"]))
    assert 0 < split_noise <= 2 * recipe_noise, (split_noise, recipe_noise)
    for a, b in zip(two[0]["on"], one):
        if not a["skipped"]:
            assert abs(a["norm"] / b["norm"] - 1) < 0.05, (a["norm"], b["norm"])


def test_bad_input_names_the_layer_and_the_fallback_says_so(two):
    msg = two[0]["messages"]
    assert "fp8_all_gather=True, but 9 fp8 layer(s) cannot" in msg["block"]
    assert "blocks.0.qkv" in msg["block"] and "fp8=block scales blocks" in msg["block"]
    assert "fp8=rowwise scales blocks" in msg["rowwise"] and "blocks.0.qkv" in msg["rowwise"]
    assert "needs an fp8 recipe" in msg["bf16"]
    # The default falls back to gathering fp32 for rowwise, and every layer's report line says so.
    lines = [ln for ln in msg["rowwise_report"].splitlines() if ln.strip().startswith(("blocks", "head"))]
    assert len(lines) == 9 and all("gathered unscaled, cast after the gather: fp8=rowwise" in ln for ln in lines)
    assert msg["rowwise_scales"] == "None"       # nothing wrapped: no e4m3 gather anywhere


# ------------------------------------------------------------------ single-process checks (no spawn)
def test_blocker_per_layer():
    layer = Fp8Linear.from_linear(nn.Linear(32, 48), Fp8Config(), "emulate")
    assert fp8_gather_blocker(layer, 2) is None and fp8_gather_blocker(layer, 4) is None
    assert fp8_gather_blocker(layer, 5) is not None          # 48 rows over 5 ranks: uneven
    assert "48 weight rows do not split evenly over 32 ranks" in fp8_gather_blocker(layer, 32)
    delayed = Fp8Linear.from_linear(nn.Linear(32, 48), Fp8Config.parse("delayed"), "emulate")
    assert fp8_gather_blocker(delayed, 2) is None
    rowwise = Fp8Linear.from_linear(nn.Linear(32, 48), Fp8Config.parse("rowwise"), "emulate")
    assert "fp8=rowwise scales blocks" in fp8_gather_blocker(rowwise, 2)
    assert fp8_gather_blocker(nn.Linear(32, 48), 2) == "not an fp8 layer"


def test_shard_weight_is_its_data_to_every_op_but_the_gather():
    data = torch.randn(4, 16)
    w = Fp8ShardWeight(data, None, 0)
    assert type(w + 1) is torch.Tensor and torch.equal(w + 1, data + 1)
    assert type(w.view(-1)) is Fp8ShardWeight and type(w.split(2)[1]) is Fp8ShardWeight
    w.mul_(2)                                  # in place: lands in the data
    assert torch.equal(data, w._data) and torch.equal(torch.as_tensor(w + 0), data)
    restored = torch.load(_saved(w), weights_only=True)      # saved as the plain tensor it stands for
    assert type(restored) is torch.Tensor and torch.equal(restored, data)


def _saved(t):
    import io
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return buf


def test_engine_before_shard_model_names_the_order():
    import mixprec
    from mixprec.distributed import shard_model
    model = W.tiny_lm()
    mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    with pytest.raises(ValueError, match="already has fp8 layers.*shard_model\\(model, recipe\\) first"):
        shard_model(model, "fp8", mesh=object())


def test_ddp_has_no_all_gather_to_run_in_fp8():
    import mixprec
    model = W.tiny_lm()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    with pytest.raises(ValueError, match="DDP replicates the weights.*shard_model"):
        wrap_ddp(mp, fp8_all_gather=True)


@pytest.mark.slow
def test_four_ranks_own_fully_shard_resume_and_delayed_scaling(tmp_path_factory):
    ranks = _spawn(tmp_path_factory, 4, resume=True)
    _check_world(ranks, 4)
    _check_own_fully_shard(ranks, 4)
    for r in range(4):      # delayed scaling: the e4m3 gather bit for bit the fp32 gather, skips alike
        on, off = ranks[r]["delayed-on"], ranks[r]["delayed-off"]
        assert [s["skipped"] for s in on] == SKIPS
        for a, b in zip(on, off):
            assert _equal(a["params"], b["params"])
        assert on[0]["wire"]["gathered"]["torch.uint8"] == 2 * W.fp8_weight_numel(W.tiny_lm())
        # The histories change in every backward, skipped or not: one all_reduce of the amaxes each step.
        assert [s["wire"]["all_reduces"] for s in on] == [[9, 1]] * STEPS
    for r in range(4):
        rec = ranks[r]["resume"]
        assert len(rec["whole"]) == len(rec["resumed"]) == STEPS - 3
        for a, b in zip(rec["whole"], rec["resumed"]):
            assert a["norm"] == b["norm"] and _equal(a["params"], b["params"])

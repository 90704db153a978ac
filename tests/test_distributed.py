"""DDP and FSDP2 on 2 CPU processes (gloo): skips in lockstep, 2 ranks == 1 rank, resume bit for bit.

One spawn runs every scenario (tests/_dist_worker.py); the tests read its records. Faults are planted
after backward on one rank only (inf on rank 0 at step 2, NaN on rank 1 at step 4), where neither DDP's
all-reduce nor FSDP's reduce-scatter can carry them to the other rank. A negative control (DDP with
the engine's reduction switched off) shows the same check fails without it.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import _dist_worker as W
from mixprec.distributed import GradSync, SyncKind, fsdp_policy, shard_model, wrap_ddp
from mixprec.distributed import run_processes

PLANTS = {2: (0, math.inf), 4: (1, math.nan)}
SKIPS = [False, False, True, False, True, False]
LOCKSTEP = [
    ("ddp", "fp32", "adamw-fused", None), ("ddp", "fp16", "sgd", None), ("ddp", "bf16", "adamw-fused", None),
    ("ddp", "fp16-pure", "adamw-fused", None), ("ddp", "bf16-pure", "sgd", None),
    ("ddp", "bf16-sr", "adamw-fused", None), ("ddp", "fp32", "sgd", "bf16"), ("ddp", "fp16", "sgd", "fp16"),
    ("fsdp", "fp32", "sgd", None), ("fsdp", "fp16", "adamw-fused", None), ("fsdp", "bf16", "sgd", None),
    ("fsdp", "fp16-pure", "adamw-fused", None), ("fsdp", "bf16-pure", "sgd", None),
    ("fsdp", "bf16-pure", "sgd", "bf16"), ("fsdp", "fp32", "sgd", "fp16"),
    # Gradient accumulation over 2 micro-batches, reduced across ranks only at the second.
    ("ddp", "fp16", "sgd", None, 2), ("fsdp", "bf16-pure", "adamw-fused", None, 2),
]
RESUME = [("ddp", "bf16-sr", "adamw-fused"), ("ddp", "fp16", "sgd"), ("fsdp", "fp16-pure", "adamw-fused"),
          ("fsdp", "bf16", "sgd")]


def _name(kind, recipe, opt, comm=None, accum=1):
    return f"{kind}-{recipe}-{opt}" + (f"-comm-{comm}" if comm else "") + (f"-accum{accum}" if accum > 1 else "")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    scenarios = [{"name": _name(*s), "kind": s[0], "recipe": s[1], "optimizer": s[2], "comm": s[3],
                  "accum": s[4] if len(s) > 4 else 1, "plants": PLANTS} for s in LOCKSTEP]
    scenarios += [{"name": "resume-" + _name(*s), "kind": s[0], "recipe": s[1], "optimizer": s[2],
                   "plants": {1: (0, math.inf)}, "resume_at": 3} for s in RESUME]
    scenarios.append({"name": "errors", "kind": "errors"})
    scenarios.append({"name": "control", "kind": "ddp", "recipe": "fp32", "optimizer": "adamw-fused",
                      "local": True, "plants": PLANTS})
    # A hang (a rank waiting in a collective for a peer that died) fails here instead of blocking CI.
    run_processes(W.worker, 2, (str(out), scenarios), backend="gloo", timeout_s=240)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", LOCKSTEP, ids=lambda c: _name(*c))
def test_one_rank_overflow_skips_on_both_ranks(ranks, case):
    r0, r1 = ranks[0][_name(*case)], ranks[1][_name(*case)]
    assert [s["skipped"] for s in r0] == SKIPS and [s["skipped"] for s in r1] == SKIPS
    for step, (a, b) in enumerate(zip(r0, r1)):
        assert a["scale"] == b["scale"], f"step {step}: loss scales differ"
        assert a["norm"] == b["norm"] or (math.isnan(a["norm"]) and math.isnan(b["norm"]))
        assert _equal(a["params"], b["params"]), f"step {step}: weights differ between ranks"
        assert _equal(a["masters"], b["masters"]), f"step {step}: master weights differ between ranks"
    for step in (2, 4):   # a skipped step leaves everything as it was, on both ranks
        for rec in (r0, r1):
            assert _equal(rec[step]["params"], rec[step - 1]["params"])
            assert _equal(rec[step]["masters"], rec[step - 1]["masters"])
    if case[1] in ("fp16", "fp16-pure"):   # dynamic scale: backed off at each skip, identically
        assert [s["scale"] for s in r0] == [2.0**16] * 2 + [2.0**15] * 2 + [2.0**14] * 2


def test_without_the_shared_reduction_the_ranks_diverge(ranks):
    """The negative control: DDP alone, engine local. Rank 1 never sees rank 0's inf and steps."""
    r0, r1 = ranks[0]["control"], ranks[1]["control"]
    assert r0[2]["skipped"] and not r1[2]["skipped"]
    assert not _equal(r0[2]["params"], r1[2]["params"])


def test_misuse_under_a_process_group_names_the_fix(ranks):
    errors = ranks[0]["errors"]
    # A plain model stays local under a live group (no collective a rank-0-only loop could hang in).
    assert errors["auto_plain_kind"] == "local"
    assert "shard_model(model, 'bf16-pure'" in errors["own_fully_shard"]
    assert "build MixedPrecision on the plain model first" in errors["pure_after_ddp"]
    assert "it was sharded for 'params=bf16" in errors["wrong_recipe"]


# Unit roundoff of the 16-bit formats: the size of one rounding where a gradient is summed or sent.
_U = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}


@functools.lru_cache(maxsize=None)
def _reference(recipe, optimizer):
    mp, forward = W.build("single", recipe, optimizer, torch.device("cpu"))
    plants = {step: (0, value) for step, (_, value) in PLANTS.items()}
    return W.train(mp, forward, W.global_batches(6), 0, 1, torch.device("cpu"), plants=plants)


@pytest.mark.parametrize("case", LOCKSTEP, ids=lambda c: _name(*c))
def test_two_ranks_match_one_rank_on_the_same_global_batch(ranks, case):
    """Splitting the batch only moves where gradient sums are rounded: each such rounding is of the
    recipe's (or the communication's) unit roundoff u. So (1) the global norm agrees within a few u
    (a norm summed twice over DDP's replicas, or missing a shard, is off by sqrt(2)), and (2) the
    weights lie no further from the 1-rank run than 2x the distance between that run and its fp32
    twin (the recipe's own rounding), plus 1e-6 for fp32 (~16 ulp at |w| ~ 1 after 6 steps)."""
    kind, recipe, optimizer, comm = case[:4]
    two, one = ranks[0][_name(*case)], _reference(recipe, optimizer)
    compute = "fp32" if recipe == "fp32" else recipe[:4]
    u = max(_U[compute], _U[comm or "fp32"])
    for a, b in zip(two, one):
        assert a["skipped"] == b["skipped"]
        if not a["skipped"]:
            assert abs(a["norm"] / b["norm"] - 1) <= 4 * u + 1e-6, (a["norm"], b["norm"])
    twin = _reference("fp32", optimizer)
    recipe_noise = max((p - q).abs().max().item() for p, q in zip(one[-1]["params"], twin[-1]["params"]))
    # Under FSDP2 a pure recipe's parameters are the fp32 shards, i.e. the 1-rank run's masters.
    same_kind = one[-1]["stepped"] if kind == "fsdp" else one[-1]["params"]
    split_noise = max((p - q).abs().max().item() for p, q in zip(two[-1]["params"], same_kind))
    bound = 2 * recipe_noise + 1e-6
    if comm is not None:
        # 16-bit communication on an fp32 recipe: 6 steps x lr x (at most 2u per gradient element of
        # size <= 1 after clipping at 1.0), times 10 for SGD momentum 0.9's accumulation.
        bound = max(bound, 6 * 0.1 * 2 * u * 10)
    assert split_noise <= bound, f"2-rank vs 1-rank {split_noise:.3g} > {bound:.3g}"


@pytest.mark.parametrize("case", RESUME, ids=lambda c: _name(*c))
def test_resumed_two_rank_run_continues_bit_for_bit(ranks, case):
    for rank in range(2):
        rec = ranks[rank]["resume-" + _name(*case)]
        assert len(rec["whole"]) == len(rec["resumed"]) == 3
        for a, b in zip(rec["whole"], rec["resumed"]):
            assert a["scale"] == b["scale"] and a["norm"] == b["norm"]
            assert _equal(a["params"], b["params"]) and _equal(a["masters"], b["masters"])


# ------------------------------------------------------------------ single-process checks (no spawn)
def test_fsdp_policy_per_recipe():
    pure = fsdp_policy("bf16-pure")
    assert (pure.param_dtype, pure.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy("bf16-pure", keep_fp32=True).param_dtype is None        # norms gather fp32
    assert fsdp_policy("fp16-pure", comm_dtype="bf16").reduce_dtype == torch.bfloat16
    for name in ("fp32", "fp16", "bf16"):                                     # autocast casts per op
        assert fsdp_policy(name).param_dtype is None and fsdp_policy(name).reduce_dtype is None
    with pytest.raises(ValueError, match="valid values: fp32, bf16, fp16"):
        fsdp_policy("bf16", comm_dtype="fp8")


def test_without_a_process_group_the_engine_stays_local():
    model = W.tiny_model()
    import mixprec
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    assert mp.grad_sync.kind is SyncKind.LOCAL
    assert GradSync(SyncKind.LOCAL).reduce_sum_squares(torch.tensor(4.0)) == 4.0


def test_misuse_errors_name_the_fix():
    import mixprec
    model = W.tiny_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    with pytest.raises(ValueError, match="init_process_group"):
        wrap_ddp(mp)
    with pytest.raises(ValueError, match="init_process_group"):
        shard_model(W.tiny_model(), "bf16-pure")
    with pytest.raises(ValueError, match="bf16-sr .* not supported under FSDP2.*bf16-pure"):
        shard_model(W.tiny_model(), "bf16-sr", mesh=object())

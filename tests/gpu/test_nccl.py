"""The single-GPU NCCL path: a process group of one, DDP and FSDP2, against the same GPU without a group.

With one rank every collective is an identity (DDP averages over 1, FSDP2 shards over 1), so the
1-rank NCCL run must equal the plain single-process run bit for bit, skips included, once both use
the same kernels. Under FSDP2 a pure recipe's parameters are the fp32 shards: they are compared with
the plain run's fp32 masters (what its optimizer steps on). What to measure on the GPU (benchmarks/RESULTS.md): the step time of
plain vs DDP(1) vs FSDP2(1) per recipe, i.e. the cost of the extra all_reduce of one fp32 scalar and
of FSDP's gathers; nothing here times anything.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/_dist_worker.py
import _dist_worker as W  # noqa: E402
from mixprec.distributed import run_processes  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible"),
              pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()),
                                 reason="this torch build has no NCCL")]

RECIPES = ["fp32", "fp16", "bf16", "fp16-pure", "bf16-pure"]
PLANTS = {2: (0, float("inf"))}


def test_one_rank_nccl_equals_the_plain_run(tmp_path):
    scenarios = [{"name": f"{kind}-{r}", "kind": kind, "recipe": r, "optimizer": "adamw-fused",
                  "plants": PLANTS} for kind in ("ddp", "fsdp") for r in RECIPES]
    scenarios.append({"name": "resume", "kind": "fsdp", "recipe": "bf16-pure", "optimizer": "adamw-fused",
                      "plants": PLANTS, "resume_at": 3})
    run_processes(W.worker, 1, (str(tmp_path), scenarios, "cuda"), backend="nccl", timeout_s=300)
    ranks = torch.load(tmp_path / "rank0.pt")
    device = torch.device("cuda", 0)
    for sc in scenarios[:-1]:
        mp, forward = W.build("single", sc["recipe"], sc["optimizer"], device)
        plain = W.train(mp, forward, W.global_batches(6), 0, 1, device, plants=PLANTS)
        nccl = ranks[sc["name"]]
        assert [s["skipped"] for s in nccl] == [s["skipped"] for s in plain] == [False, False, True] + [False] * 3
        for a, b in zip(nccl, plain):
            assert a["scale"] == b["scale"], sc["name"]
            # On CUDA the group path squares each _foreach_norm result and sums, the plain path takes
            # vector_norm of them: equal up to an ulp or two (on CPU both sum the same dots: bitwise).
            # The norm stays below the clip (1.0), so the weights must still agree bit for bit.
            assert a["norm"] == pytest.approx(b["norm"], rel=1e-6, nan_ok=True), sc["name"]
            expected = b["stepped"] if sc["kind"] == "fsdp" else b["params"]
            assert all(torch.equal(p, q) for p, q in zip(a["params"], expected)), sc["name"]
    resumed = ranks["resume"]
    for a, b in zip(resumed["whole"], resumed["resumed"]):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))

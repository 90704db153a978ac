"""fp8 under FSDP2 on one GPU (NCCL, a group of one): the e4m3 all-gather path with torch._scaled_mm.

One GPU cannot measure the all-gather itself (with one rank FSDP2 copies instead of calling the
collective), but the cast before the gather, the gathered e4m3 weight going into ``_scaled_mm`` and
the scales' refresh all run as on many GPUs. The gathered bytes and scale must equal the whole
weight's cast bit for bit, and the run with the e4m3 gather must equal the run gathering fp32 (the
layer casting after the gather) step for step: the same scale, the same e4m3 bytes, the same GEMMs.
The cost of the cast: ``python benchmarks/step/bench_dist.py --fsdp-fp8 --nproc 1 --device cuda``.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/_fp8_dist_worker.py
import _fp8_dist_worker as W  # noqa: E402
from mixprec.devices import probe_fp8_kernel  # noqa: E402
from mixprec.distributed import run_processes  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible"),
              pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()),
                                 reason="this torch build has no NCCL")]


def test_one_gpu_e4m3_gather_equals_the_fp32_gather(tmp_path):
    if not probe_fp8_kernel("current", torch.device("cuda", 0)).ok:
        pytest.skip("this GPU runs no fp8 GEMM (compute capability 8.9+ needed)")
    plants = {2: (0, math.inf)}
    scenarios = [{"name": "on", "recipe": "fp8", "steps": 4, "plants": plants},
                 {"name": "off", "recipe": "fp8", "steps": 4, "fp8_all_gather": False, "plants": plants},
                 {"name": "gathered"}]
    run_processes(W.worker, 1, (str(tmp_path), scenarios, "cuda"), backend="nccl", timeout_s=300)
    rank = torch.load(tmp_path / "rank0.pt")
    assert all(rank["gathered"].values()) and len(rank["gathered"]) == 9, rank["gathered"]
    assert "weight all-gathered in e4m3" in rank["on:report"] and "backend scaled_mm" in rank["on:report"]
    on, off = rank["on"], rank["off"]
    assert [s["skipped"] for s in on] == [s["skipped"] for s in off] == [False, False, True, False]
    for step, (a, b) in enumerate(zip(on, off)):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), step

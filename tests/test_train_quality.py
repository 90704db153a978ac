"""Long-horizon training quality in lockstep (issue 35): slow; the full table is benchmarks/quality/train_quality.py.

Every recipe trains the lab's gpt from the same weights on the same batches (``mixprec compare``), so the
per-step training losses of two recipes can be compared directly. mxfp8 and fp8-rowwise quantize every
element that is normal in e4m3 to the same value (tests/test_blockscale.py), so their curves must stay
together step by step; a bias or a wrong axis in either would pull them apart long before 800 steps
(on the H100, 800 iterations of benchmarks/quality/train_quality.py: 0.002 apart on the mean of 3 seeds,
fp32's seed band being 0.022).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# The run, in a process of its own whose CPU kernels are pinned to AVX2 (ATen's vectorized kernels and
# oneDNN's): the bounds below were measured on AVX2 kernels, and an AVX-512 machine (native bf16 dot
# products) moves 60 lockstep steps of bf16 autocast by more than they allow (mxfp8 against rowwise 0.149
# there, on the code before and after issue 52; pinned, the same machine gives the figures below exactly).
_RUN = """
import json, warnings
from mixprec.lab.compare.run import plan_compare, run_compare
warnings.simplefilter("ignore")                         # the "emulated on cpu" notices
report = run_compare(plan_compare("gpt", ["fp32", "fp8-rowwise", "mxfp8"], steps=60, device="cpu",
                                  seed=0, eval_every=60))
print(json.dumps({r.label: {"losses": r.losses, "test": r.test_metric} for r in report.runs}))
"""


def test_mxfp8_trains_in_lockstep_with_rowwise_and_fp32():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    fp32, row, mx = (runs[k]["losses"] for k in ("fp32", "fp8-rowwise", "mxfp8"))
    # Step by step (the same batch at each step): mxfp8 against rowwise, and against fp32. Measured on
    # a CPU (torch 2.13): largest step gaps 0.037 and 0.057, test losses fp32 2.451, rowwise 2.433,
    # mxfp8 2.472: lockstep runs drift apart by a few hundredths from rounding-order changes alone
    # (benchmarks/HISTORY.md, issue 35: the same rowwise recipe on a kernel and emulated ends up to 0.029 apart).
    # The issue reported mxfp8 0.65-1.34 above fp32; these bounds sit at 2-3x the drift.
    assert max(abs(a - b) for a, b in zip(mx, row)) < 0.1
    assert max(abs(a - b) for a, b in zip(mx, fp32)) < 0.15
    assert abs(runs["mxfp8"]["test"] - runs["fp8-rowwise"]["test"]) < 0.1
    assert runs["mxfp8"]["test"] < runs["fp32"]["test"] + 0.1

"""SQNR of every fp8/fp4 format's linear against the bf16 ``nn.Linear``, on random normal data.

x ~ N(0, 1) of shape (512, 1024), W as ``nn.Linear(1024, 1024)`` initialises it, upstream gradient
g ~ N(0, 1). The reference is the same ``nn.Linear`` under bf16 autocast; each format runs as an
``Fp8Linear`` holding the very same Parameters, under the same autocast, emulated (exact rounding,
fp32 matmuls: the numbers a kernel would give, to within fp32 summation order). Every layer first
runs forward and backward on two other batches (delayed scaling then has a history that is not
this batch's own; nvfp4's stochastic rounding has advanced). SQNR in dB = 10 log10(|ref|^2 /
|ref - fmt|^2) of the output, the input gradient and the weight gradient.

The issue's goals: rowwise and block >= per-tensor current; mxfp8 >= 25 dB; nvfp4 >= 10 dB.

The step time of these recipes on the lab's gpt: ``python benchmarks/fp8/bench_fp8_cpu_step.py --recipes
"bf16;fp8;fp8-rowwise;fp8-block;mxfp8;nvfp4"``.

Usage: python benchmarks/fp8/fp8_formats_sqnr.py [--seeds 3] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from mixprec import Fp8Config
from mixprec.fp8 import Fp8Linear

from fp8_sqnr import fwd_bwd, sqnr_db     # the per-tensor script's measure (benchmarks/ is on the path)

FORMATS = {
    "current": "current", "delayed": "delayed", "rowwise": "rowwise", "block": "block", "mxfp8": "mxfp8",
    "nvfp4": "nvfp4", "nvfp4 (no rht)": "nvfp4(rht=false)", "nvfp4 (no sr)": "nvfp4(sr=false)",
    "nvfp4 (no sr, no rht)": "nvfp4(sr=false,rht=false)",
}
GOALS = {"mxfp8": 25.0, "nvfp4": 10.0}


def measure(seed: int) -> dict[str, tuple[float, float, float]]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    linear = nn.Linear(1024, 1024)
    batches = [(torch.randn(512, 1024, generator=gen), torch.randn(512, 1024, generator=gen)) for _ in range(3)]
    *warmup, (x, g) = batches
    ref = fwd_bwd(linear, linear.weight, x, g)
    out = {}
    for name, spec in FORMATS.items():
        layer = Fp8Linear.from_linear(linear, Fp8Config.parse(spec), "emulate")
        layer.reseed(seed)
        for wx, wg in warmup:
            fwd_bwd(layer, linear.weight, wx, wg)
        got = fwd_bwd(layer, linear.weight, x, g)
        out[name] = tuple(sqnr_db(r, o) for r, o in zip(ref, got))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="seeds to average over (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds takes a count of at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [measure(seed) for seed in range(args.seeds)]
    print(f"SQNR (dB) against bf16 nn.Linear, x (512, 1024) ~ N(0,1), W nn.Linear(1024, 1024) init, g ~ N(0,1); "
          f"mean of {args.seeds} seed(s); torch {torch.__version__}, emulated")
    print(f"  {'format':<24} {'output':>7} {'grad_x':>7} {'grad_W':>7}")
    for name in FORMATS:
        mean = [sum(r[name][i] for r in runs) / len(runs) for i in range(3)]
        print(f"  {name:<24} {mean[0]:7.2f} {mean[1]:7.2f} {mean[2]:7.2f}")
    current = [sum(r["current"][i] for r in runs) / len(runs) for i in range(3)]
    verdicts = []
    for name in ("rowwise", "block"):
        mean = [sum(r[name][i] for r in runs) / len(runs) for i in range(3)]
        verdicts.append(f"{name} >= current: {all(m >= c for m, c in zip(mean, current))}")
    for name, floor in GOALS.items():
        mean = [sum(r[name][i] for r in runs) / len(runs) for i in range(3)]
        verdicts.append(f"{name} >= {floor:g} dB: {min(mean) >= floor}")
    print("goals: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()

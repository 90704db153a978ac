"""How far does fp8 training end from bf16? Measured per workload and seed, side by side.

For every seed, bf16 and the fp8 recipes train the same workload from that seed's initial weights and
minibatch order (``mixprec.lab.compare``). Printed: each run's test metric and final train loss, each fp8
run's difference from bf16 under the same seed, and bf16's own spread over the seeds for scale.

Usage: python benchmarks/quality/fp8_tolerance.py [--workloads mlp,gpt] [--seeds 0,1,2] [--recipes fp8,fp8-delayed]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mixprec.fp8 import probe_scaled_mm
from mixprec.lab.compare.run import plan_compare, run_compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="mlp,gpt")
    ap.add_argument("--recipes", default="fp8,fp8-delayed", help="fp8 recipes compared with bf16")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="default: each workload's own")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    recipes = ["bf16"] + args.recipes.split(",")
    backend = "torch._scaled_mm" if probe_scaled_mm("cpu").ok else "emulation"
    print(f"torch {torch.__version__}, cpu ({backend}), {args.threads} thread(s), seeds {seeds}\n")
    for workload in args.workloads.split(","):
        metric: dict[str, list[float]] = {r: [] for r in recipes}
        loss: dict[str, list[float]] = {r: [] for r in recipes}
        for seed in seeds:
            report = run_compare(plan_compare(workload, recipes, steps=args.steps, device="cpu", seed=seed))
            for run in report.runs:
                metric[run.label].append(run.test_metric)
                loss[run.label].append(run.final_loss)
            line = "  ".join(f"{r.label} {r.test_metric:.4f} ({r.wall_s:.0f} s)" for r in report.runs)
            print(f"  {workload} seed {seed}: {line}", flush=True)
        better = "higher" if report.higher_is_better else "lower"
        print(f"{workload}: test {report.metric} ({better} is better), {report.steps} steps; bf16 over seeds: "
              f"[{min(metric['bf16']):.4f}, {max(metric['bf16']):.4f}]")
        print(f"  {'recipe':<12}{'mean':>9}{'min':>9}{'max':>9}{'train loss':>12}"
              f"{'mean diff':>11}{'max |diff|':>12}  (diff: recipe - bf16, same seed)")
        for label in recipes:
            diffs = [a - b for a, b in zip(metric[label], metric["bf16"])]
            print(f"  {label:<12}{statistics.fmean(metric[label]):>9.4f}{min(metric[label]):>9.4f}"
                  f"{max(metric[label]):>9.4f}{statistics.fmean(loss[label]):>12.4f}"
                  f"{statistics.fmean(diffs):>+11.4f}{max(abs(d) for d in diffs):>12.4f}")
        print(flush=True)


if __name__ == "__main__":
    main()

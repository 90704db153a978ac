"""Is each mixed recipe within fp32's own seed-to-seed noise? Measured, per workload.

For every seed, every recipe trains from that seed's initial weights and minibatch order
(``mixprec.lab.compare``). fp32's spread over the seeds is the noise band; a recipe is "within noise"
when its mean test metric is inside fp32's [min, max] over the seeds, widened by nothing.

Usage: python benchmarks/quality/seed_noise.py [--workloads mlp,cnn,gpt] [--seeds 0,1,2,3,4] [--steps N]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mixprec.lab.compare.run import DEFAULT_RECIPES, plan_compare, run_compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="mlp,cnn,gpt")
    ap.add_argument("--recipes", default=",".join(DEFAULT_RECIPES + ("bf16-pure", "bf16-sr")))
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--steps", type=int, default=None, help="default: each workload's own")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    # Recipe strings hold commas ("bf16-sr,moments=bf16-sr"): with a ';' anywhere, ';' separates them.
    recipes = args.recipes.split(";" if ";" in args.recipes else ",")
    print(f"torch {torch.__version__}, cpu, {args.threads} thread(s), seeds {seeds}\n")
    for workload in args.workloads.split(","):
        metric: dict[str, list[float]] = {}    # by the run's label: a custom recipe's is its full string
        for seed in seeds:
            report = run_compare(plan_compare(workload, recipes, steps=args.steps, device="cpu", seed=seed))
            for run in report.runs:
                metric.setdefault(run.label, []).append(run.test_metric)
        lo, hi = min(metric["fp32"]), max(metric["fp32"])
        better = "higher" if report.higher_is_better else "lower"
        print(f"{workload}: test {report.metric} ({better} is better), {report.steps} steps; "
              f"fp32 band over seeds [{lo:.4f}, {hi:.4f}]")
        width = max(10, *(len(r) + 2 for r in metric))
        print(f"  {'recipe':<{width}}{'mean':>9}{'std':>9}{'min':>9}{'max':>9}  within fp32's band")
        for label, values in metric.items():
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"  {label:<{width}}{mean:>9.4f}{std:>9.4f}{min(values):>9.4f}{max(values):>9.4f}  "
                  f"{'yes' if lo <= mean <= hi else 'NO'}")
        print()


if __name__ == "__main__":
    main()

"""Does every recipe train a small char GPT as fp32 does, over a long horizon? Lockstep, several seeds.

Each (recipe, seed) run trains ``lockstep.train_lockstep``'s GPT (nanogpt_train.py's model and loop:
2 layers, 64 wide, batch 32 x 64, AdamW 3e-3 with warm-up and cosine decay, clip 1.0) from that
seed's weights on that seed's batches, so at a given seed every recipe sees the same init and data.
fp32's spread over the seeds at each evaluation is the band. Per recipe it reports the final
validation loss (mean over seeds), the gap to fp32 at the same seed, whether the mean is inside
fp32's final band, and **where it leaves the band**: the first evaluation from which the recipe's
mean stays outside fp32's band at every later evaluation ("-" if it never does, or comes back).

    python benchmarks/quality/train_quality.py                                 # every recipe, 3 seeds, 800 iters
    python benchmarks/quality/train_quality.py --quick                         # 3 recipes, 2 seeds, 200 iters
    python benchmarks/quality/train_quality.py --recipes "fp32;mxfp8" --seeds 0,1 --iters 400 --n-embd 32 --batch 16
    python benchmarks/quality/train_quality.py --device cuda --workers 12 --json runs.jsonl

Runs go to ``--workers`` processes (one thread each); ``--json`` appends one line per run (the whole
curve), and ``--from-json`` re-renders a table from such a file without training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lockstep import run_jobs  # noqa: E402

RECIPES = ("fp32", "bf16", "fp16", "fp16-pure", "bf16-pure", "bf16-sr", "bf16-kahan", "fp8", "fp8-delayed",
           "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4", "bf16,fp8=nvfp4(sr=false,rht=false)",
           "bf16,fp8=nvfp4(rht=false)", "bf16,fp8=nvfp4(sr=false)")
QUICK = ("fp32", "fp8-rowwise", "mxfp8")


def summarize(results: list[dict]) -> dict[str, dict]:
    """Per recipe label: final mean/min/max, per-seed gap to fp32, inside fp32's band, where it leaves it."""
    curves = {(r["label"], r["seed"]): dict((int(i), v) for i, v in r["curve"]) for r in results}
    labels = list(dict.fromkeys(r["label"] for r in results))
    if "fp32" not in labels:
        raise ValueError("train_quality needs fp32 among the recipes: it is the band")
    seeds = sorted({s for (lab, s) in curves if lab == "fp32"})
    points = sorted(set.intersection(*(set(curves[("fp32", s)]) for s in seeds)))
    band = {p: (min(curves[("fp32", s)][p] for s in seeds), max(curves[("fp32", s)][p] for s in seeds))
            for p in points}
    out = {}
    for lab in labels:
        mine = [s for s in seeds if (lab, s) in curves]
        mean = {p: statistics.fmean(curves[(lab, s)][p] for s in mine) for p in points
                if all(p in curves[(lab, s)] for s in mine)}
        outside = [p for p in mean if not band[p][0] <= mean[p] <= band[p][1]]
        leaves = None
        for p in sorted(mean):                      # the first point after which it never comes back
            if all(q in outside for q in mean if q >= p):
                leaves = p
                break
        last = max(mean)
        finals = [curves[(lab, s)][last] for s in mine]
        out[lab] = {"mean": mean[last], "min": min(finals), "max": max(finals),
                    "gap": [curves[(lab, s)][last] - curves[("fp32", s)][last] for s in mine],
                    "inside": band[last][0] <= mean[last] <= band[last][1],
                    "above": mean[last] > band[last][1], "leaves": leaves, "seeds": mine, "last": last}
    return out


def render(results: list[dict]) -> str:
    """The markdown table of ``summarize``."""
    s = summarize(results)
    f = s["fp32"]
    lines = [f"fp32's band at iteration {f['last']} over seeds {f['seeds']}: [{f['min']:.4f}, {f['max']:.4f}]", "",
             "| recipe | val loss, mean (min-max) | minus fp32, per seed | inside fp32's band | leaves the band at |",
             "|---|---|---|---|---|"]
    for lab, r in s.items():
        where = "-" if r["leaves"] is None else f"iter {r['leaves']}" + (" (above)" if r["above"] else " (below)")
        inside = "-" if lab == "fp32" else ("yes" if r["inside"] else "no, " + ("above" if r["above"] else "below"))
        lines.append(f"| {lab} | {r['mean']:.4f} ({r['min']:.4f}-{r['max']:.4f}) | "
                     + " / ".join(f"{g:+.3f}" for g in r["gap"]) + f" | {inside} | {where} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default=";".join(RECIPES), help="';'-separated; fp32 is added if missing")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--iters", type=int, default=800)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="fp32, fp8-rowwise, mxfp8; seeds 0,1; 200 iterations")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64, help="width (a multiple of 16 keeps the linears fp8)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=64, help="context length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json", default=None, help="append one JSON line per run here")
    ap.add_argument("--from-json", default=None, help="render this file's runs; train nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        results = [json.loads(line) for line in open(args.from_json) if line.strip()]
        print(render(results))
        return
    recipes = list(QUICK) if args.quick else [r for r in args.recipes.split(";") if r]
    seeds = [0, 1] if args.quick else [int(s) for s in args.seeds.split(",")]
    iters = 200 if args.quick else args.iters
    if "fp32" not in recipes:
        recipes.insert(0, "fp32")
    shape = {"n_layer": args.n_layer, "n_embd": args.n_embd, "batch": args.batch, "block": args.block}
    jobs = [("recipe", r, r, s, iters, args.eval_every, args.device, shape) for s in seeds for r in recipes]
    print(f"torch {torch.__version__}, {args.device}, {len(recipes)} recipes x {len(seeds)} seeds, {iters} "
          f"iterations, {args.workers} worker(s), model {shape}", flush=True)
    print(render(run_jobs(jobs, args.workers, args.json)))


if __name__ == "__main__":
    main()

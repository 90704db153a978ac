"""bf16-sr and bf16-pure against the hand-written torch.autocast bf16 loop: a whole training step each.

The model is a small GPT (``mixprec.lab.models.GPT``: 4 layers, d=256, vocabulary 256, context 64,
batch 8) trained with AdamW. The torch.amp side is the loop a user would write: fp32 weights,
``torch.autocast("cpu", torch.bfloat16)`` around the forward and loss, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()``. The mixprec side is the same loop through
``MixedPrecision`` under each recipe asked for.

All engines are built first and then stepped round-robin, one step each per round (amp, recipe 1,
recipe 2, amp, ...; the order rotates each round), on the same batch, so a slow spell of a shared
machine hits every side of a round alike. A round's ratio is recipe / amp for that round; the
figure is the median of those ratios with their 10th-90th percentile range beside it, and the
median step time of each side. ``--clock cpu`` times this process's CPU time instead of the wall
clock (steadier where other jobs share the CPU). One thread (``torch.set_num_threads(1)``) unless
``--threads`` says otherwise.

``--part update`` times only the update (``mp.step()`` against ``optimizer.step()``; the forward,
backward and ``zero_grad`` still run each round, untimed): where the recipes differ from torch.amp
beyond the matmuls, which on a CPU without bf16 instructions take nearly all of a step.

``--batch`` and ``--tokens`` shrink the batch (the update's work does not depend on it).

Usage: python benchmarks/step/bench_sr_step.py [--rounds 30] [--warmup 3] [--recipes bf16-sr,bf16-pure]
       [--optimizers foreach,fused] [--part whole|update] [--clock wall|cpu] [--threads 1]
       [--batch 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import mixprec
from mixprec.lab.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)
BATCH = 8


def _optimizer(params, kind: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=kind == "fused", foreach=None if kind == "fused" else True)


def _model() -> GPT:
    torch.manual_seed(0)      # every side starts from the same weights
    return GPT(CONFIG)


def amp_step(kind: str, part: str = "whole", clock=time.perf_counter):
    """One step of the hand-written torch.autocast bf16 loop, as a closure over its model and optimizer;
    it returns the seconds ``part`` took."""
    model = _model()
    opt = _optimizer(model.parameters(), kind)

    def step(x, y) -> float:
        t0 = clock()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        t1 = clock()
        opt.step()
        t2 = clock()
        opt.zero_grad()
        return clock() - t0 if part == "whole" else t2 - t1
    return step


def mixprec_step(recipe: str, kind: str, part: str = "whole", clock=time.perf_counter, package=mixprec):
    """One step of the same loop through ``package.MixedPrecision`` under ``recipe`` (a closure, as
    ``amp_step``)."""
    model = _model()
    mp = package.MixedPrecision(model, _optimizer(model.parameters(), kind), recipe)

    def step(x, y) -> float:
        t0 = clock()
        with mp.autocast():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        mp.backward(loss)
        t1 = clock()
        mp.step()
        t2 = clock()
        mp.zero_grad()
        return clock() - t0 if part == "whole" else t2 - t1
    return step


def run_rounds(sides: dict, x, y, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Step every side once per round, the order rotating; the seconds of each, per side."""
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name](x, y)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:    # rotate who goes first
            times[name].append(sides[name](x, y))
    return times


def report(kind: str, times: dict[str, list[float]], base: str = "amp") -> None:
    """One line per side: its median, the base's, and the median and p10-p90 of the per-round ratio."""
    for name, ts in times.items():
        if name == base:
            continue
        ratios = sorted(t / a for t, a in zip(ts, times[base]))
        p10, p90 = ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]
        print(f"{kind:10s} {name:16s} {1e3 * statistics.median(ts):9.2f} "
              f"{1e3 * statistics.median(times[base]):9.2f} {statistics.median(ratios):7.3f}  "
              f"{p10:6.3f}-{p90:6.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--recipes", default="bf16-sr,bf16-pure")
    ap.add_argument("--optimizers", default="foreach,fused")
    ap.add_argument("--part", choices=("whole", "update"), default="whole")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    ap.add_argument("--tokens", type=int, default=CONFIG.block_size, help="tokens per sequence")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CONFIG.vocab_size, (args.batch, args.tokens), generator=g)
    y = torch.randint(0, CONFIG.vocab_size, (args.batch, args.tokens), generator=g)
    recipes = args.recipes.split(",")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, {args.rounds} rounds, "
          f"part={args.part}; GPT {CONFIG.n_layer}x{CONFIG.n_embd}, batch {args.batch}x{args.tokens}")
    print(f"{'optimizer':10s} {'recipe':16s} {'ms':>9s} {'amp ms':>9s} {'ratio':>7s}  {'p10-p90':>13s}")
    for kind in args.optimizers.split(","):
        sides = {"amp": amp_step(kind, args.part, clock)}
        sides |= {r: mixprec_step(r, kind, args.part, clock) for r in recipes}
        report(kind, run_rounds(sides, x, y, args.rounds, args.warmup))


if __name__ == "__main__":
    main()

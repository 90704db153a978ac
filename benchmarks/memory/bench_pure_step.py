"""The pure-recipe optimizer step at 16 B/param against the step that held fp32 gradients (20 B/param).

``MixedPrecision.step()`` now casts the 16-bit gradients into fp32 per chunk and frees them after the
chunk's update (update/chunks.py). The old step, which filled every fp32 copy's gradient at once and kept it,
is still what the engine runs while a step observer is attached; a no-op observer selects it, so both
run from the same code in one process, interleaved (old, new, old, new ...), on the same gradients.

``--chunk-mib`` sets the new step's ``chunk_bytes`` (64 MiB is the default; a small value gives several
chunks on a small model). The fixed gradients are stepped again and again, so the usage checks are told
they came from ``mp.backward``, and between steps the fp32 copies' gradients are freed as
``mp.zero_grad()`` frees them in a training loop (both outside the timing). ``--clock cpu`` times this
process's CPU time instead of the wall clock: steadier where other jobs share the CPU.

Each row builds the pair of engines ``--builds`` times (old first, then new first, ...) and times
each build on its own: the same step was measured up to 20% faster in one build than in another on
this CPU (where the allocator places the weights, moments and workspace), so one build can fake a
regression or hide one. "old/new" is the geometric mean of the builds' ratios, which follow it.

Usage: python benchmarks/memory/bench_pure_step.py [--device cpu|cuda] [--reps 20] [--widths 1024,2048]
       [--chunk-mib 64,4] [--clock wall|cpu] [--builds 4]
       [--optimizers fused,foreach]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch import nn

import mixprec


class _NoOp:
    def before_step(self, engine):
        pass

    def after_step(self, engine, found_inf):
        pass


def build(width: int, depth: int, device, recipe: str, fused: bool, old: bool, chunk_mib: float = 64):
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    model = nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
    mp = mixprec.MixedPrecision(model, opt, recipe, clip_grad_norm=1.0)
    mp.master.chunk_bytes = int(chunk_mib * 2**20)
    if old:
        mp.add_step_observer(_NoOp())
    g = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():      # fixed 16-bit gradients, reused by every step
        p.grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(p.dtype)
    return mp


def timed(mp, device, clock=time.perf_counter) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    # The same fixed gradients every step: tell the usage checks they came from mp.backward (they
    # would refuse a second step on unchanged gradients), and free the fp32 copies' gradients as
    # mp.zero_grad() does in a training loop (the old step cast into fresh ones each step), untimed.
    mp._checks.via_engine = True
    mp.master.zero_grad()
    t0 = clock()
    mp.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--widths", default="1024,2048")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--recipes", default="fp16-pure,bf16-pure")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--builds", type=int, default=4, help="builds of the old/new pair, orders alternating")
    ap.add_argument("--optimizers", default="fused,foreach", help="AdamW flavours: fused, foreach or both")
    ap.add_argument("--chunk-mib", default="64,4", help="chunk_bytes of the new step, in MiB")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (time.process_time), steadier on a shared CPU")
    args = ap.parse_args()
    if args.builds < 1 or args.reps < 1:
        ap.error("--builds and --reps must be at least 1")
    if not set(args.optimizers.split(",")) <= {"fused", "foreach"}:
        ap.error(f"--optimizers takes fused, foreach or both (comma-separated), got {args.optimizers!r}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, {device}, {args.threads} thread(s); MLP of depth {args.depth}; "
          f"AdamW, clip 1.0; {args.builds} builds of the pair (old first, new first, ...), {args.reps} "
          f"interleaved reps each, medians of step() alone ({args.clock} clock)")
    print(f"{'recipe':<10} {'width':>6} {'params':>8} {'optimizer':<8} {'MiB':>4} {'chunks':>6} {'old ms':>9} "
          f"{'new ms':>9} {'old/new':>8}  per build")
    rows = [(recipe, int(width), float(chunk_mib), fused) for recipe in args.recipes.split(",")
            for width in args.widths.split(",") for chunk_mib in args.chunk_mib.split(",")
            for fused in [o == "fused" for o in args.optimizers.split(",")]]
    for recipe, width, chunk_mib, fused in rows:
        # The pair of engines is built several times, alternating which is built first, and each build
        # is timed on its own: on this CPU the same step ran up to 20% slower in one build than in
        # another (where 700 MB of weights, moments and workspace land), enough to fake a regression.
        # old/new is the geometric mean of the builds' ratios; old ms and new ms their medians.
        ratios, olds, news = [], [], []
        for b in range(args.builds):
            order = (True, False) if b % 2 == 0 else (False, True)
            built = {o: build(width, args.depth, device, recipe, fused, o, chunk_mib) for o in order}
            old, new = built[True], built[False]
            plan = new.master._plan(new.optimizer)
            chunks = 1 if plan is None else len(plan)
            n = sum(p.numel() for p in new.model.parameters())
            for engine in (old, new):      # warm-up: optimizer state, allocator
                timed(engine, device)
            t_old, t_new = [], []
            for _ in range(args.reps):
                t_old.append(timed(old, device, clock))
                t_new.append(timed(new, device, clock))
            olds.append(statistics.median(t_old))
            news.append(statistics.median(t_new))
            ratios.append(olds[-1] / news[-1])
            del built, old, new, engine, plan     # freed before the next build is made
            gc.collect()
        mo, mn = statistics.median(olds) * 1e3, statistics.median(news) * 1e3
        print(f"{recipe:<10} {width:>6} {n / 1e6:>7.1f}M {'fused' if fused else 'foreach':<8} "
              f"{chunk_mib:>4g} {chunks:>6} {mo:>9.2f} {mn:>9.2f} {statistics.geometric_mean(ratios):>7.2f}x  "
              + " ".join(f"{r:.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()

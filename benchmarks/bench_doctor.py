"""The cost of the doctor's range collection: a plain engine step against one with collection off and on.

Four variants of the same training step (forward, backward, ``mp.step()``, ``zero_grad``) on a built-in
workload's model, batch and optimizer, interleaved (plain, off, on, then off, on, plain, ...: the order
rotates) so drift in clock speed or load hits all alike:

- plain: no collector at all;
- off:   ``with collector.collecting(enabled=False)``: must install nothing and cost nothing;
- on:    ``with collector.collecting()`` with ``fused=True`` (compiled counting): every module's activations and activation gradients, every
         weight, weight gradient and update counted exactly on the device, plus update underflow;
- eager: the same with ``RangeCollector(fused=False)``: no torch.compile, the eager table route (the
         CPU's default, and what a machine without a working compiler gets), side by side with "on".

Prints medians and the ratios off/plain, on/plain and eager/plain.
Usage: python benchmarks/bench_doctor.py [--workloads mlp,gpt] [--recipes fp32,fp16] [--reps 30]
       [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mixprec
from mixprec.diagnostics.range_collector import RangeCollector
from mixprec.lab.workloads import get_workload


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup(workload_name: str, recipe: str, device: torch.device):
    w = get_workload(workload_name)
    data = w.load_data()
    torch.manual_seed(0)
    model = w.build_model().to(device)
    mp = mixprec.MixedPrecision(model, w.make_optimizer(model.parameters()), recipe)
    idx = torch.arange(w.batch_size) % len(data.y_train)
    x, y = data.x_train[idx].to(device), data.y_train[idx].to(device)
    collector = RangeCollector(mp, fused=True)
    eager = RangeCollector(mp, fused=False)

    def step(context):
        with context:
            with mp.autocast():
                loss = w.loss_fn(model(x), y)
            mp.backward(loss)
            mp.step()
        mp.zero_grad()

    class _Null:
        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    return {"plain": lambda: step(_Null()),
            "off": lambda: step(collector.collecting(enabled=False)),
            "on": lambda: step(collector.collecting()),
            "eager": lambda: step(eager.collecting())}, collector


def interleave(fns: dict, reps: int, device: torch.device) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3):                       # warm-up: allocator, lazy optimizer state, first hooks
        for fn in fns.values():
            fn()
    names = list(fns)
    for rep in range(reps):
        # Rotate the order each rep: whichever runs right after "on" also pays for freeing its garbage.
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = fns[name]
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,gpt")
    parser.add_argument("--recipes", default="fp32,fp16")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.reps} interleaved reps, medians")
    print(f"{'workload':<9} {'recipe':<6} {'plain ms':>9} {'off ms':>8} {'on ms':>8} {'eager ms':>8} "
          f"{'off/plain':>9} {'on/plain':>8} {'eager/plain':>11}")
    for workload in args.workloads.split(","):
        for recipe in args.recipes.split(","):
            fns, collector = setup(workload, recipe, device)
            t = interleave(fns, args.reps, device)
            print(f"{workload:<9} {recipe:<6} {1e3 * t['plain']:>9.2f} {1e3 * t['off']:>8.2f} "
                  f"{1e3 * t['on']:>8.2f} {1e3 * t['eager']:>8.2f} {t['off'] / t['plain']:>8.2f}x "
                  f"{t['on'] / t['plain']:>7.2f}x {t['eager'] / t['plain']:>10.2f}x", flush=True)
            assert collector.result().steps == args.reps + 3   # "on" really collected every time


if __name__ == "__main__":
    main()

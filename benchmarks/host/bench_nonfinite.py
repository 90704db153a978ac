"""The cost of MixedPrecision(trace_nonfinite=True): a training step with the NaN/Inf tracer on vs off.

For each workload (the lab's mlp and gpt) and recipe, two engines train identical copies of the model on
the same minibatches; their steps are interleaved (off, on, off, on, ...) so load drift hits both alike.
A step is forward + backward + step + zero_grad; ``last_overflow`` is not read (clean steps never sync).
Off installs nothing: what remains of the option in the hot path is two ``nullcontext``s and one
``is not None`` per step, timed here on their own.

Prints median step times and the ratio on / off, twice: by the wall clock, and by this thread's CPU
time (``time.thread_time``: with one torch thread on the CPU the whole step runs on it, and a step
preempted by other processes on a shared machine is not charged for the wait).
Usage: python benchmarks/host/bench_nonfinite.py [--reps 20] [--threads 1] [--recipes fp32,fp16] [--workloads mlp,gpt]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import timeit

import torch

import mixprec
from mixprec.lab.workloads import get_workload


def engines(workload, recipe):
    out = {}
    for name, trace in (("off", False), ("on", True)):
        torch.manual_seed(0)
        model = workload.build_model()
        opt = workload.make_optimizer(model.parameters())
        out[name] = (model, mixprec.MixedPrecision(model, opt, recipe, trace_nonfinite=trace))
    return out


def step(model, mp, loss_fn, x, y):
    with mp.autocast():
        loss = loss_fn(model(x), y)
    mp.backward(loss)
    mp.step()
    mp.zero_grad()


def bench(workload_name, recipe, reps):
    w = get_workload(workload_name)
    data = w.load_data()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, len(data.y_train), (w.batch_size,), generator=g) for _ in range(reps + 3)]
    pair = engines(w, recipe)
    times = {k: [] for k in pair}
    cpu = {k: [] for k in pair}
    ops = 0
    for i, idx in enumerate(batches):
        x, y = data.x_train[idx], data.y_train[idx]
        for name, (model, mp) in pair.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            step(model, mp, w.loss_fn, x, y)
            if i >= 3:                                     # the first steps create optimizer state
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
            if name == "on":
                ops = len(mp._overflow_check[2])           # ops traced in that step
    wall = statistics.median(times["off"]), statistics.median(times["on"])
    return wall, (statistics.median(cpu["off"]), statistics.median(cpu["on"])), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recipes", default="fp32,fp16")
    parser.add_argument("--workloads", default="mlp,gpt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.reps} interleaved steps each, medians")
    print(f"{'':18} {'--------- wall clock ---------':>30} {'------ thread CPU time -------':>30}")
    print(f"{'workload':8} {'recipe':9} {'off ms':>9} {'on ms':>9} {'on/off':>9} {'off ms':>9} {'on ms':>9} "
          f"{'on/off':>9} {'ops/step':>9}")
    for workload in args.workloads.split(","):
        for recipe in args.recipes.split(","):
            (off, on), (coff, con), ops = bench(workload, recipe, args.reps)
            print(f"{workload:8} {recipe:9} {off * 1e3:9.2f} {on * 1e3:9.2f} {on / off:8.2f}x "
                  f"{coff * 1e3:9.2f} {con * 1e3:9.2f} {con / coff:8.2f}x {ops:9d}")
    # What "off" leaves in the hot path: autocast() and backward() each enter a nullcontext.
    per = timeit.timeit("with nullcontext(): pass\nwith nullcontext(): pass\nNone is not None",
                        globals={"nullcontext": contextlib.nullcontext}, number=100_000) / 100_000
    print(f"off-path code per step (2 nullcontexts + 1 test): {per * 1e6:.2f} us")


if __name__ == "__main__":
    main()

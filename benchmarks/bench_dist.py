"""What lockstep costs across processes, timed side by side in one run (each rank interleaves A, B, A, B).

1. ``mp.step()`` under DDP with the engine's shared reduction (one all_reduce of one fp32 scalar)
   against the same step with ``process_group=None`` (local, not in lockstep): the price of the
   guarantee that every rank skips and clips alike.
2. A whole DDP training step with fp32 gradient all-reduce against torch's 16-bit compression hook
   (``wrap_ddp(comm_dtype="bf16")``): half the bytes on the wire, plus two casts per bucket.

Prints rank 0's medians and ratios. Usage:
    python benchmarks/bench_dist.py [--nproc 2] [--device cpu|cuda] [--width 1024] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.distributed import wrap_ddp
from mixprec.distributed import default_backend, run_processes


def _model(width: int, device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 10)).to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, world: int, device_type: str, width: int, reps: int, recipe: str, threads: int) -> None:
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    x = torch.randn(64, width, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def engine(process_group, comm=None):
        model = _model(width, device)
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe,
                                    clip_grad_norm=1.0, process_group=process_group)
        forward = wrap_ddp(mp, comm_dtype=comm) if process_group is not None else \
            nn.parallel.DistributedDataParallel(model)
        return mp, forward

    def backward(mp, forward):
        with mp.autocast():
            mp.backward(F.cross_entropy(forward(x), y))

    def time_step(mp, forward):           # only mp.step(): the reduction lives there
        backward(mp, forward)
        _sync(device)
        dist.barrier()
        t = time.perf_counter()
        mp.step()
        _sync(device)
        dt = time.perf_counter() - t
        mp.zero_grad()
        return dt

    def time_iteration(mp, forward):      # forward, backward (with DDP's all-reduce), step
        _sync(device)
        dist.barrier()
        t = time.perf_counter()
        backward(mp, forward)
        mp.step()
        _sync(device)
        dt = time.perf_counter() - t
        mp.zero_grad()
        return dt

    def time_all_reduce(*_):               # the collective alone: one fp32 scalar
        t_scalar = torch.ones((), device=device)
        _sync(device)
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(t_scalar, op=dist.ReduceOp.MAX)
        _sync(device)
        return time.perf_counter() - t

    shared, local = engine("auto"), engine(None)
    fp32_comm, bf16_comm = shared, engine("auto", comm="bf16")
    results = {"all_reduce of one scalar": [], "step: shared reduction": [], "step: local only": [], "iteration: fp32 all-reduce": [],
               "iteration: bf16 all-reduce": []}
    for i in range(reps + 3):             # 3 warm-up rounds: lazy state, first-touch allocations
        pairs = [("all_reduce of one scalar", time_all_reduce, (None, None)),
                 ("step: shared reduction", time_step, shared), ("step: local only", time_step, local),
                 ("iteration: fp32 all-reduce", time_iteration, fp32_comm),
                 ("iteration: bf16 all-reduce", time_iteration, bf16_comm)]
        for name, fn, (mp, forward) in (pairs if i % 2 == 0 else pairs[::-1]):
            dt = fn(mp, forward)
            if i >= 3:
                results[name].append(dt)
    if rank == 0:
        params = sum(p.numel() for p in shared[0].model.parameters())
        print(f"{world} ranks ({default_backend(device_type)}), {device_type}, recipe {recipe}, "
              f"{params / 1e6:.2f}M params, {reps} interleaved reps, {threads} thread(s) per rank")
        med = {k: statistics.median(v) * 1e3 for k, v in results.items()}
        for k, v in med.items():
            print(f"  {k:28s} {v:8.3f} ms")
        print(f"  step with / without the shared reduction: {med['step: shared reduction'] / med['step: local only']:.3f}x")
        print(f"  iteration bf16 / fp32 gradient all-reduce: "
              f"{med['iteration: bf16 all-reduce'] / med['iteration: fp32 all-reduce']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--recipes", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for recipe in args.recipes.split(","):
        run_processes(_rank, args.nproc, (args.device, args.width, args.reps, recipe, args.threads),
                      backend=default_backend(args.device), timeout_s=600)


if __name__ == "__main__":
    main()

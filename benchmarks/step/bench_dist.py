"""What lockstep costs across processes, timed side by side in one run (each rank interleaves A, B, A, B).

1. ``mp.step()`` under DDP with the engine's shared reduction (one all_reduce of one fp32 scalar)
   against the same step with ``process_group=None`` (local, not in lockstep): the price of the
   guarantee that every rank skips and clips alike.
2. A whole DDP training step with fp32 gradient all-reduce against torch's 16-bit compression hook
   (``wrap_ddp(comm_dtype="bf16")``): half the bytes on the wire, plus two casts per bucket.

3. ``--fsdp-fp8``: an fp8 recipe under FSDP2 (``shard_model``) with the e4m3 all-gather on against
   off (``fp8_all_gather=False``: the weights gathered in fp32 and cast by each layer): bytes each
   rank's all-gathers assemble per step, by dtype (counted at ``dist.all_gather_single``), and the
   time of a whole step; then the cast-before-gather alone (one weight shard to e4m3 with its
   precomputed scale) against the bf16 cast FSDP2 would make with ``param_dtype=bf16``, and the
   scales' all_reduce. On one GPU (``--nproc 1 --device cuda``, NCCL, world size 1) the all-gather is a
   local copy: what it measures is the cast's cost, not the wire's.

Prints rank 0's medians and ratios. Usage:
    python benchmarks/step/bench_dist.py [--nproc 2] [--device cpu|cuda] [--width 1024] [--reps 30]
    python benchmarks/step/bench_dist.py --fsdp-fp8 [--nproc 2] [--device cpu|cuda] [--width 1024] [--reps 10]
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


def _fsdp_fp8_rank(rank: int, world: int, device_type: str, width: int, reps: int, _recipe: str,
                   threads: int) -> None:
    """fp8 under FSDP2, e4m3 all-gather on vs off: bytes per step by dtype, step time, the cast alone."""
    import collections

    from mixprec.distributed import shard_model
    from mixprec.fp8.fsdp_weight import gather_scales_of

    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    x = torch.randn(64, width, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    gathered: collections.Counter = collections.Counter()
    orig = dist.all_gather_single

    def counting_all_gather(output, input, *a, **k):
        gathered[str(output.dtype).replace("torch.", "")] += output.numel() * output.element_size()
        return orig(output, input, *a, **k)

    def engine(on: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width, bias=False), nn.GELU())],
                              nn.Linear(width, 16, bias=False)).to(device)
        shard_model(model, "fp8", units=(nn.Linear,), fp8_all_gather=on)
        return mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=device.type == "cuda"),
                                      "fp8")

    def iteration(mp) -> float:
        _sync(device)
        dist.barrier()
        t = time.perf_counter()
        with mp.autocast():
            mp.backward(F.cross_entropy(mp.model(x), y))
        mp.step()
        mp.zero_grad()
        _sync(device)
        return time.perf_counter() - t

    engines = {"e4m3 all-gather": engine(True), "fp32 all-gather": engine(False)}
    wire = {}
    dist.all_gather_single = counting_all_gather
    try:
        for name, mp in engines.items():
            iteration(mp)                      # first step: lazy init, the first scale refresh
            gathered.clear()
            iteration(mp)
            wire[name] = dict(gathered)
    finally:
        dist.all_gather_single = orig
    times = {name: [] for name in engines}
    for i in range(reps + 2):
        for name, mp in (list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]):
            dt = iteration(mp)
            if i >= 2:
                times[name].append(dt)
    # The cast alone, on this rank's shard of the first weight.
    scales = gather_scales_of(engines["e4m3 all-gather"].model)
    shard = scales.weights[0]._local_tensor
    cast_times, bf16_times, refresh_times = [], [], []
    for _ in range(reps + 2):
        _sync(device)
        t = time.perf_counter()
        shard.fsdp_pre_all_gather(None, None, None, None, None)
        _sync(device)
        cast_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        shard._data.to(torch.bfloat16)
        _sync(device)
        bf16_times.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        scales.refresh()
        _sync(device)
        refresh_times.append(time.perf_counter() - t)
    if rank == 0:
        params = sum(p.numel() for p in engines["fp32 all-gather"].model.parameters())
        print(f"fp8 under FSDP2: {world} rank(s) ({default_backend(device_type)}), {device_type}, "
              f"{params / 1e6:.2f}M params in {len(scales.names)} fp8 linears, {reps} interleaved reps, "
              f"{threads} thread(s) per rank")
        for name in engines:
            total = sum(wire[name].values())
            print(f"  {name}: {total:,} bytes gathered per step per rank {wire[name]}, "
                  f"step {statistics.median(times[name]) * 1e3:.3f} ms")
        # World size 1: FSDP2 copies instead of calling the collective (0 bytes), but the pre- and
        # post-all-gather hooks still run: the scales' refresh count shows the e4m3 path was taken.
        ratio = sum(wire["e4m3 all-gather"].values()) / max(1, sum(wire["fp32 all-gather"].values()))
        print(f"  scale refreshes (one per changed step): {scales.refreshes}; "
              f"bytes e4m3 / fp32 gather: {ratio:.3f}; step time e4m3 / fp32 gather: "
              f"{statistics.median(times['e4m3 all-gather']) / statistics.median(times['fp32 all-gather']):.3f}x")
        med = statistics.median
        print(f"  one shard {tuple(shard.shape)}: cast to e4m3 before the gather {med(cast_times[2:]) * 1e3:.4f} ms, "
              f"bf16 cast {med(bf16_times[2:]) * 1e3:.4f} ms; the scales' all_reduce "
              f"({len(scales.names)} amaxes) {med(refresh_times[2:]) * 1e3:.4f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--recipes", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fsdp-fp8", action="store_true",
                        help="fp8 under FSDP2: the e4m3 all-gather on against off (bytes, step time, cast cost)")
    args = parser.parse_args()
    if args.fsdp_fp8:
        run_processes(_fsdp_fp8_rank, args.nproc, (args.device, args.width, args.reps, "fp8", args.threads),
                      backend=default_backend(args.device), timeout_s=600)
        return
    for recipe in args.recipes.split(","):
        run_processes(_rank, args.nproc, (args.device, args.width, args.reps, recipe, args.threads),
                      backend=default_backend(args.device), timeout_s=600)


if __name__ == "__main__":
    main()

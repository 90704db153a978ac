"""The doctor's counting routes, one piece at a time: eager torch ops, the compiled kernel plus a count
(what a GPU runs), and on a CPU the C counter (range_count.c), side by side in one process.

Each row counts the same ``randn`` piece by each route (the calls RangeHistogram makes), checks that
they agree bin for bin, and prints the mean time per value over ``--reps`` calls after a warm-up,
with the ratio of each torch route to the C one.
Usage: python benchmarks/doctor/bench_range_count.py [--sizes 1024,32768,131072,524288]
       [--dtypes fp32,bf16,fp16] [--reps 50] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from mixprec.diagnostics.range_bins import count_piece
from mixprec.diagnostics.range_native import count_native, native_counter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ns_per_value(fn, n: int, reps: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps / n * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,32768,131072,524288")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown or args.reps < 1:
        parser.error(f"--dtypes takes {', '.join(DTYPES)} (got {unknown}); --reps must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    native = device.type == "cpu" and native_counter() is not None
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, mean of "
          f"{args.reps} calls, ns per value" + ("" if native else " (no C counter here)"))
    print(f"{'values':>8} {'dtype':<5} {'eager':>7} {'compiled':>9} {'C':>6} {'eager/C':>8} {'compiled/C':>10}")
    g = torch.Generator().manual_seed(0)
    for n in (int(s) for s in args.sizes.split(",")):
        for name in args.dtypes.split(","):
            x = torch.randn(n, generator=g).to(DTYPES[name]).to(device)
            routes = {"eager": lambda: count_piece(x, None, (n,), fused=False),
                      "compiled": lambda: count_piece(x, None, (n,), fused=True)}
            if native:
                routes["C"] = lambda: count_native(x, None, (n,))
            results = [fn() for fn in routes.values()]
            for counts, amax in results[1:]:      # the same numbers, or the timings mean nothing
                assert torch.equal(counts.cpu(), results[0][0].cpu()) and torch.equal(amax.cpu(), results[0][1].cpu())
            t = {k: ns_per_value(fn, n, args.reps, device) for k, fn in routes.items()}
            c = t.get("C")
            ratios = (f"{t['eager'] / c:>7.2f}x {t['compiled'] / c:>9.2f}x" if c else f"{'-':>8} {'-':>10}")
            print(f"{n:>8} {name:<5} {t['eager']:>7.2f} {t['compiled']:>9.2f} "
                  f"{(f'{c:.2f}' if c else '-'):>6} {ratios}", flush=True)


if __name__ == "__main__":
    main()

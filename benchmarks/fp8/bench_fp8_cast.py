"""One fp8 cast (amax, scale, saturating cast, transposed copy) fused against eager, by tensor size.

fp8/fused.py compiles the cast into two kernels; eagerly it is about a dozen. Compiled, a call costs
more host time (Dynamo's guards and the compiled function's wrappers) and less device time (two passes
over the tensor instead of six). Which wins depends on the size: this prints, per size, the host time
of a call (until it returns, no sync) and the wall time of a synced call, median of interleaved reps,
so the size above which the fused cast pays can be read off.

    python benchmarks/fp8/bench_fp8_cast.py --device cuda
    python benchmarks/fp8/bench_fp8_cast.py --device cpu --sizes 64x64,1024x1024 --reps 20    # a dry run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.fp8.fused import _cast_role, fused_cast
from mixprec.fp8.layer_state import ROLES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="64x64,256x256,1024x1024,2048x2048,4096x4096,8192x8192")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fmt = ROLES["input"]
    print(f"torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; bf16 input, e4m3, current scaling, with the transposed copy; medians of {args.reps} "
          "interleaved reps")
    print(f"{'size':>12}{'host us fused':>15}{'host us eager':>15}{'wall us fused':>15}{'wall us eager':>15}"
          f"{'wall eager/fused':>18}")
    for size in args.sizes.split(","):
        rows, cols = (int(v) for v in size.split("x"))
        x = torch.randn(rows, cols, device=device).to(torch.bfloat16)
        sb = torch.ones((), device=device)
        ab = torch.zeros((), device=device)
        sides = {
            "fused": lambda: fused_cast(x, sb, ab, None, fmt, algo="max", margin=0, pow2=False, record=False,
                                        want_t=True),
            "eager": lambda: _cast_role(x, sb, ab, None, fmt, "max", 0, False, False, True),
        }
        for fn in sides.values():
            for _ in range(5):
                fn()
        host = {k: [] for k in sides}
        wall = {k: [] for k in sides}
        for _ in range(args.reps):
            for name, fn in sides.items():
                sync()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                host[name].append(t1 - t0)
                wall[name].append(t2 - t0)
        h = {k: statistics.median(v) * 1e6 for k, v in host.items()}
        w = {k: statistics.median(v) * 1e6 for k, v in wall.items()}
        print(f"{size:>12}{h['fused']:>15.1f}{h['eager']:>15.1f}{w['fused']:>15.1f}{w['eager']:>15.1f}"
              f"{w['eager'] / w['fused']:>18.2f}", flush=True)


if __name__ == "__main__":
    main()

"""fp8 linear against bf16 nn.Linear (and torchao's Float8Linear where installed), forward + backward.

For each size S, one (S x S) input through an S -> S linear layer (M = K = N = S), bf16 weights and
input, a random bf16 output gradient. Each measurement is one forward and one backward (input and
weight gradients). The variants run interleaved (A, B, C, A, B, C, ...) in one process and the
medians are compared; ratios above 1 mean the fp8 layer is faster than bf16.

    python benchmarks/fp8/bench_fp8.py                        # CUDA, S = 4096 and 8192 (goal: >= 1.4x at 8192)
    python benchmarks/fp8/bench_fp8.py --compile              # each layer under torch.compile as well
    python benchmarks/fp8/bench_fp8.py --cpu-smoke            # CPU, S = 256: checks the script, not speed

mixprec's layers run with eager casts (the default); the ", fused casts" rows are the same layers
with ``fused_casts = True`` (fp8/fused.py's compiled casts: fewer kernels, but slower from 1024x1024
up on an H200, benchmarks/fp8/bench_fp8_cast.py). The kernels column counts GPU kernels per forward +
backward.

fp8 speed needs fp8 tensor cores (compute capability 8.9+); on a CPU the script refuses unless
``--cpu-smoke`` asks for a small run that only shows it works.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch import nn

from mixprec import Fp8Config
from mixprec.fp8 import Fp8Linear
from mixprec.fp8 import probe_scaled_mm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    layer(x).backward(g)


def _time_once(fn, device: torch.device) -> float:
    """Milliseconds for one call: CUDA events on a GPU, perf_counter on a CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _variants(size: int, device: torch.device, compile_: bool) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = nn.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16)
    variants: dict[str, nn.Module] = {"bf16 nn.Linear": base}
    backend = "scaled_mm" if probe_scaled_mm(device).ok else "emulate"
    for name, cfg in (("mixprec fp8 current", Fp8Config()), ("mixprec fp8 delayed", Fp8Config.parse("delayed"))):
        layer = Fp8Linear.from_linear(copy.deepcopy(base), cfg, backend)
        variants[name] = layer                             # eager casts: the default
        if not compile_ and backend == "scaled_mm":       # fp8/fused.py's compiled casts, opted into
            with_fused = Fp8Linear.from_linear(copy.deepcopy(base), cfg, backend)
            with_fused.fused_casts = True
            variants[f"{name}, fused casts"] = with_fused
    # Blocked scalings (issue 25): rowwise through _scaled_mm's row scales, block through the Hopper
    # 1x128/128x128 kernel; on a device without them the layer emulates (a notice says so).
    for name, cfg in (("mixprec fp8 rowwise", Fp8Config.parse("rowwise")),
                      ("mixprec fp8 block", Fp8Config.parse("block"))):
        variants[name] = Fp8Linear.from_linear(copy.deepcopy(base), cfg, backend)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training   # optional
        variants["torchao Float8Linear"] = convert_to_float8_training(nn.Sequential(copy.deepcopy(base)))
        variants["torchao Float8Linear rowwise"] = convert_to_float8_training(
            nn.Sequential(copy.deepcopy(base)), config=Float8LinearConfig.from_recipe_name("rowwise"))
    except ImportError:
        pass
    if compile_:
        variants = {f"{k} (compiled)": torch.compile(v) for k, v in variants.items()}
    return variants


def bench(size: int, device: torch.device, reps: int, warmup: int, compile_: bool) -> None:
    variants = _variants(size, device, compile_)
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(warmup):
        for layer in variants.values():
            _fwd_bwd(layer, x, g)
    _sync(device)
    for _ in range(reps):                       # interleaved: drift and noise hit every variant alike
        for name, layer in variants.items():
            times[name].append(_time_once(lambda: _fwd_bwd(layer, x, g), device))
    flops = 3 * 2 * size**3                     # forward, input gradient, weight gradient
    ref = statistics.median(times[next(iter(times))])
    print(f"M=K=N={size}: median of {reps} (forward + backward)")
    print(f"  {'variant':<40}{'ms':>10}{'TFLOP/s':>10}{'speed-up vs bf16':>18}{'kernels':>9}")
    for name, samples in times.items():
        ms = statistics.median(samples)
        kernels = _kernels_per_call(lambda: _fwd_bwd(variants[name], x, g), device)
        print(f"  {name:<40}{ms:>10.3f}{flops / ms / 1e9:>10.1f}{ref / ms:>17.2f}x{kernels:>9}")
    print(flush=True)


def _kernels_per_call(fn, device: torch.device, calls: int = 3) -> str:
    """GPU kernels (and memsets/copies) per call from torch.profiler; '-' on a CPU (no kernels)."""
    if device.type != "cuda":
        return "-"
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return f"{n / calls:.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="4096,8192", help="comma-separated S (M = K = N = S)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also torch.compile each layer")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run on the CPU at S = 256 to check the script works (not a speed figure)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, sizes = torch.device("cpu"), [256]
        torch.set_num_threads(1)
    else:
        device = torch.device(args.device)
        if device.type != "cuda" or not torch.cuda.is_available():
            print("bench_fp8: error: fp8 speed needs a CUDA GPU with fp8 tensor cores (compute capability "
                  "8.9+), and none is in use here; run with --device cuda on such a GPU, or pass "
                  "--cpu-smoke for a small CPU run that checks the script only", file=sys.stderr)
            return 2
        sizes = [int(s) for s in args.sizes.split(",")]
    support = probe_scaled_mm(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, fp8 backend: "
          f"{'torch._scaled_mm' if support.ok else 'emulation (' + support.reason + ')'}\n")
    for size in sizes:
        bench(size, device, args.reps, args.warmup, args.compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Why does ResNet-50 train slower in bf16 than in fp16? Layout and BatchNorm, measured side by side.

The H100 run of 2026-11-22 (compare-resnet50.txt) had fp16 1.84x and bf16 1.49x over fp32. The same
convolutions run on the same tensor cores in both; what differs, reading torch's source:

- BatchNorm. Under autocast, batch_norm follows its input: a bf16 activation with fp32 weights. torch's
  ``_batch_norm_impl_index`` sends fp16 input with fp32 weights to cuDNN, but excludes bf16 input from
  cuDNN (``input.scalar_type() != at::kBFloat16``): bf16 runs ATen's own batch-norm kernels. ResNet-50
  has 53 BatchNorms, each forward and backward.
- Layout. The model is NCHW; tensor-core convolutions work in NHWC, so cuDNN transposes around NCHW
  convolutions (``nchwToNhwc`` kernels) unless the model and input are ``channels_last``.

For fp16 and bf16, NCHW and channels_last, this times training steps (interleaved, medians) and
profiles one step: the share of GPU time in BatchNorm kernels, in layout transposes, and the longest
BatchNorm kernel's name (cuDNN's ``bn_fw_tr_...`` against ATen's ``batch_norm_collect_statistics``).
Usage: python benchmarks/step/bench_convnet_layout.py [--device cuda] [--batch 128] [--reps 10]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.nn.functional as F

import mixprec
from mixprec.lab.models import ResNet50

_BN = re.compile(r"batch_norm|batchnorm|bn_fw|bn_bw|bn_|welford", re.IGNORECASE)
_TRANSPOSE = re.compile(r"nchwToNhwc|nhwcToNchw|transpose", re.IGNORECASE)


def setup(recipe: str, channels_last: bool, device: torch.device, batch: int, size: int):
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = ResNet50().to(device=device, memory_format=fmt)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), recipe)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=fmt)
    y = torch.randint(0, 1000, (batch,), device=device)

    def step():
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return step


def kernel_shares(step, device: torch.device) -> tuple[float, float, str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [(e.name, e.device_time_total) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    total = sum(t for _, t in kernels) or 1.0
    bn = [(n, t) for n, t in kernels if _BN.search(n)]
    longest = max(bn, key=lambda k: k[1])[0][:70] if bn else "-"
    return (sum(t for _, t in bn) / total, sum(t for n, t in kernels if _TRANSPOSE.search(n)) / total, longest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    variants = {(r, cl): setup(r, cl, device, args.batch, args.size)
                for r in ("fp16", "bf16") for cl in (False, True)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in variants.values():
        for _ in range(3):           # warm-up: cuDNN picks its algorithms, the optimizer makes its state
            fn()
    times: dict = {k: [] for k in variants}
    keys = list(variants)
    for rep in range(args.reps):
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            sync()
            t0 = time.perf_counter()
            variants[key]()
            sync()
            times[key].append(time.perf_counter() - t0)
    print(f"device {device}, torch {torch.__version__}, ResNet-50 batch {args.batch} at {args.size}px, "
          f"{args.reps} interleaved reps, medians")
    base = statistics.median(times[("fp16", False)])
    print(f"{'recipe':7} {'layout':14} {'ms/step':>8} {'vs fp16 NCHW':>13} {'BN share':>9} {'transposes':>11}  longest BN kernel")
    for (recipe, cl), ts in times.items():
        ms = statistics.median(ts)
        bn, tr, name = kernel_shares(variants[(recipe, cl)], device) if device.type == "cuda" else (0.0, 0.0, "-")
        print(f"{recipe:7} {'channels_last' if cl else 'NCHW':14} {ms * 1e3:8.1f} {base / ms:12.2f}x "
              f"{bn:9.1%} {tr:11.1%}  {name}")


if __name__ == "__main__":
    main()

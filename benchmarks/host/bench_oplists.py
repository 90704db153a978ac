"""The cost of edited op lists against plain torch.autocast, on the lab's gpt workload, side by side.

Each variant trains its own copy of the gpt workload's model (same initial weights, same batch, the
workload's AdamW) for one step at a time: forward under its autocast, loss, backward, optimizer step.
Variants are interleaved (A, B, C, ... repeatedly) and the median step time of each is printed with its
ratio to plain torch.autocast:

- ``torch.autocast``: the hand-written loop, ``with torch.autocast(...)``;
- ``mixprec, default lists``: ``MixedPrecision(..., "bf16").autocast()``, which installs nothing;
- ``mixprec, <edits>``: the op-list mode installed. ``fp32_ops=layer_norm`` changes no arithmetic on
  the CPU (layer_norm's inputs are fp32 there anyway), so its row is the cost of the mechanism alone:
  one Python call per torch function in the forward; the other rows also change what is computed.

The engine's own ``step()`` (norm, clipping) is not used: every variant calls ``optimizer.step()``, so
only the op-list machinery differs. Usage::

    python benchmarks/host/bench_oplists.py [--threads 1] [--reps 15] [--batch 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

import mixprec
from mixprec.lab.workloads import get_workload
from mixprec.casting.oplists import OpListMode, OpPolicy

EDITS = ["fp32_ops=layer_norm", "fp32_ops=layer_norm+gelu", "fp32_ops=scaled_dot_product_attention",
         "follow_ops=linear"]


class _CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    workload = get_workload("gpt")
    data = workload.load_data()
    x, y = data.x_train[:args.batch].to(device), data.y_train[:args.batch].to(device)

    def build():
        torch.manual_seed(0)
        model = workload.build_model().to(device)
        return model, workload.make_optimizer(model.parameters())

    steps = {}
    model, opt = build()

    def plain(model=model, opt=opt):
        with torch.autocast(device.type, dtype=low):
            loss = workload.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    steps["torch.autocast"] = plain

    recipes = {"mixprec, default lists": args.dtype}
    recipes |= {f"mixprec, {e}": f"{args.dtype},{e}" for e in EDITS}
    for label, recipe in recipes.items():
        model, opt = build()
        # Only mp.autocast() is used: backward and step are the same plain calls as torch.autocast's.
        mp = mixprec.MixedPrecision(model, opt, recipe)

        def ours(model=model, opt=opt, mp=mp):
            with mp.autocast():
                loss = workload.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps[label] = ours

    counter = _CountCalls()
    with torch.autocast(device.type, dtype=low), counter:
        workload.loss_fn(build()[0](x), y)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = {k: [] for k in steps}
    for _ in range(3):                                 # warm-up: allocator, lazy optimizer state
        for fn in steps.values():
            fn()
    for _ in range(args.reps):
        for name, fn in steps.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["torch.autocast"]
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} thread(s); gpt workload "
          f"(2 blocks, width 64, T=64), batch {args.batch}, {args.dtype} autocast")
    print(f"{counter.calls} torch function calls per forward; {args.reps} interleaved reps, medians\n")
    print(f"{'variant':<52}{'step ms':>10}{'vs torch.autocast':>20}")
    for name, t in med.items():
        print(f"{name:<52}{t * 1e3:>10.2f}{t / base:>19.3f}x")

    # The mechanism's cost per torch function that it passes through untouched, measured on a tiny
    # add (interleaved batches of 2000 calls, medians): the upper bound of the mode's cost per forward
    # is this times the number of torch function calls per forward.
    a, b = torch.ones(4, device=device), torch.ones(4, device=device)
    mode = OpListMode({"layer_norm": OpPolicy.FP32}, device.type)
    per_call = {"without mode": [], "with mode": []}
    for _ in range(args.reps * 2):
        for name in per_call:
            with torch.autocast(device.type, dtype=low), (mode if name == "with mode" else contextlib.nullcontext()):
                t0 = time.perf_counter()
                for _ in range(2000):
                    torch.add(a, b)
                per_call[name].append((time.perf_counter() - t0) / 2000)
    extra = statistics.median(per_call["with mode"]) - statistics.median(per_call["without mode"])
    print(f"\nmode cost per untouched torch call: {extra * 1e6:.2f} us "
          f"(torch.add alone {statistics.median(per_call['without mode']) * 1e6:.2f} us); "
          f"x {counter.calls} calls = {extra * counter.calls * 1e3:.2f} ms per forward, "
          f"{extra * counter.calls / base * 100:.2f}% of the torch.autocast step")


if __name__ == "__main__":
    main()

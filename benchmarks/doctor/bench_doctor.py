"""The cost of the doctor's range collection: a plain engine step against one with collection off and on.

Five variants of the same training step (forward, backward, ``mp.step()``, ``zero_grad``) on a built-in
workload's model, batch and optimizer, interleaved (plain, off, on, ..., then off, on, ..., plain: the
order rotates) so drift in clock speed or load hits all alike:

- plain: no collector at all;
- off:   ``with collector.collecting(enabled=False)``: must install nothing and cost nothing;
- on:    ``with collector.collecting()``, ``RangeCollector`` as ``mixprec doctor`` makes it (``fused=None``):
         every module's activations and activation gradients, every weight, weight gradient and update
         counted exactly on the device, plus update underflow; the counting compiled (Triton on a GPU,
         C on a CPU), the lost-update test compiled on a GPU only;
- fused: the same with ``fused=True``: the lost-update test compiled on a CPU too (Inductor);
- eager: the same with ``fused=False``: eager torch ops only (what a machine without a compiler gets).

Prints medians and each variant's ratio to plain.
Usage: python benchmarks/doctor/bench_doctor.py [--workloads mlp,gpt] [--recipes fp32,fp16] [--reps 30]
       [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

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
    collectors = {"on": RangeCollector(mp), "fused": RangeCollector(mp, fused=True),
                  "eager": RangeCollector(mp, fused=False)}

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

    fns = {"plain": lambda: step(_Null()), "off": lambda: step(collectors["on"].collecting(enabled=False))}
    for name, collector in collectors.items():
        fns[name] = lambda collector=collector: step(collector.collecting())
    return fns, collectors["on"]


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
    parser.add_argument("--markdown", metavar="PATH", help="also write the table as markdown to PATH (after each row)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.reps} interleaved reps, medians")
    names = ("plain", "off", "on", "fused", "eager")
    title = (f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
             + f", torch {torch.__version__}, {args.reps} interleaved reps, medians")
    cols = ["workload", "recipe"] + [f"{n} ms" for n in names] + [f"{n}/plain" for n in names[1:]]
    rows: list[list[str]] = []
    print(f"{'workload':<9} {'recipe':<6} " + " ".join(f"{n + ' ms':>9}" for n in names) + " "
          + " ".join(f"{n + '/plain':>11}" for n in names[1:]))
    for workload in args.workloads.split(","):
        for recipe in args.recipes.split(","):
            fns, collector = setup(workload, recipe, device)
            t = interleave(fns, args.reps, device)
            print(f"{workload:<9} {recipe:<6} " + " ".join(f"{1e3 * t[n]:>9.2f}" for n in names) + " "
                  + " ".join(f"{t[n] / t['plain']:>10.2f}x" for n in names[1:]), flush=True)
            assert collector.result().steps == args.reps + 3   # "on" really collected every time
            rows.append([workload, recipe] + [f"{1e3 * t[n]:.2f}" for n in names]
                        + [f"{t[n] / t['plain']:.2f}" for n in names[1:]])
            if args.markdown:
                Path(args.markdown).write_text("\n".join(
                    [title, "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
                    + ["| " + " | ".join(r) + " |" for r in rows]) + "\n")


if __name__ == "__main__":
    main()

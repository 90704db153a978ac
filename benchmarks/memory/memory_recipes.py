"""Bytes per parameter and saved activations per recipe on a workload: predicted, and measured on CUDA.

For issue 13: pure recipes at 16 B/param with AdamW, bf16-sr with bf16 moments at 8, and the saved
activations of each recipe against fp32's (the ratio), with the fp32 tensors a recipe still saves, by
the op that made them. On the CPU the model is built on the meta device and only predicted (fake
tensors); on CUDA it is built for real and one step per recipe is measured beside the prediction.

Usage: python benchmarks/memory/memory_recipes.py [--benchmark gpt2] [--device cpu|cuda] [--recipes "a;b"]
"""

from __future__ import annotations

import argparse

import torch

from mixprec import memory_report
from mixprec.lab.compare.render import format_bytes
from mixprec.lab.workloads import get_workload

RECIPES = ("fp32;bf16;bf16,saved=exact;bf16,saved=low;bf16-pure;bf16-pure,saved=exact;bf16-pure,saved=low;"
           "fp16-pure;fp8;bf16-sr;bf16-sr,moments=bf16-sr;bf16-sr,moments=fp8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--benchmark", default="gpt2", help="a workload or benchmark name")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", default=RECIPES, help="recipe strings separated by ';'")
    args = ap.parse_args()
    device = torch.device(args.device)
    w = get_workload(args.benchmark)
    measure = device.type == "cuda"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("meta" if not measure else device):
            model = w.build_model()
    data = w.load_data()
    x, y = data.x_train[:w.batch_size].clone(), data.y_train[:w.batch_size].clone()
    if measure:
        x, y = x.to(device), y.to(device)
    print(f"{w.name}, batch {w.batch_size}, torch {torch.__version__}, {device}: "
          f"{'predicted and measured (one real step)' if measure else 'predicted (fake tensors)'}")
    base = None
    for recipe in args.recipes.split(";"):
        r = memory_report(model, recipe, (x, y), optimizer=w.make_optimizer, loss_fn=w.loss_fn, measure=measure)
        base = base or r.predicted.activations
        fp32 = [f"{op} {format_bytes(b)}" for op, dt, b in r.saved if dt == "float32"][:3]
        line = (f"  {recipe:26s} B/param {r.bytes_per_param:5.2f}  activ {format_bytes(r.predicted.activations):>8s}"
                f"  vs fp32 {r.predicted.activations / base:.3f}")
        if r.measured is not None:
            m = r.measured
            held = (m.params + m.grads + m.master + m.optimizer) / r.n_params
            line += (f"  measured B/param {held:5.2f} activ {format_bytes(m.activations):>8s}"
                     f" peak {format_bytes(m.peak) if m.peak is not None else '-'}")
        print(line + f"  fp32 saves: {', '.join(fp32) or '-'}", flush=True)


if __name__ == "__main__":
    main()

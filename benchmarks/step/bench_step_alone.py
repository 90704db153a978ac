"""``mp.step()`` alone, eager against ``compile_step()``, beside torch's fused AdamW on the same gradients.

Where ``bench_parity.py``'s compile_step rows sit at 1.0x on a CPU, this says why: it times only the
step (norm, overflow check, fused AdamW) on fixed random gradients, for the engine's eager fused path,
for ``mp.compile_step()``, and for torch's fused AdamW with no check at all (the torch.amp bf16 loop's
step). Models as in bench_parity (full sizes). Steps interleaved; medians in ms.

Usage: python benchmarks/step/bench_step_alone.py [--model lm|mlp|lm-large] [--recipe bf16] [--steps 15]
       [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import mixprec
from bench_parity import adamw, make_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="lm")
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)

    def engine(compiled: bool):
        model = make_model(args.model, False, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mp = mixprec.MixedPrecision(model, adamw(model, True), args.recipe)
        return model, (mp.compile_step() if compiled else mp)

    torch.manual_seed(1)
    plain = make_model(args.model, False, device)
    grads = [torch.randn_like(p) * 1e-3 for p in plain.parameters()]
    sides = {"mixprec eager": engine(False), "mixprec compile_step": engine(True),
             "torch fused AdamW": (plain, adamw(plain, True))}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(4 + args.steps):              # 4 warm-up rounds (compile_step compiles in the first)
        for name, (model, stepper) in sides.items():
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stepper.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 4:
                times[name].append(time.perf_counter() - t0)
            stepper.zero_grad()
    n = sum(p.numel() for p in plain.parameters())
    print(f"torch {torch.__version__}, {device}, 1 thread, {args.model} ({n / 1e6:.1f}M parameters), "
          f"{args.recipe}, {args.steps} steps: median ms per step")
    for name, ts in times.items():
        print(f"  {name:22s} {statistics.median(ts) * 1e3:8.2f}  (range {min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})")


if __name__ == "__main__":
    main()

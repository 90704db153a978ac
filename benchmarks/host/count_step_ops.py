"""Top-level aten ops (each one kernel launch on a GPU) in one fp16 training step and in ``mp.step()``,
with the dynamic loss-scale update eager and fused (``mixprec.fusion``), counted with torch.profiler.

    python benchmarks/host/count_step_ops.py [--device cpu|cuda]

Counts are exact, not timings: they do not depend on the machine's load. On CUDA the fused update is
the default; here both are shown side by side.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import mixprec


def _mlp(device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)).to(device)


def _top_level_ops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    device = torch.device(ap.parse_args().device)
    x, y = torch.randn(16, 64, device=device), torch.randint(0, 10, (16,), device=device)
    print(f"torch {torch.__version__}, {device}: MLP 3x64, fp16, fused AdamW, clip 1.0")
    for fused in (False, True):
        model = _mlp(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                        "fp16", clip_grad_norm=1.0)
        mp.loss_scale.fused = fused

        def forward_backward():
            with mp.autocast():
                loss = F.cross_entropy(model(x), y)
            mp.backward(loss)

        def whole():
            forward_backward()
            mp.step()
            mp.zero_grad()
        for _ in range(3):       # warm-up: optimizer state, the fused update's compile
            whole()
        n_whole = _top_level_ops(whole)
        forward_backward()
        n_step = _top_level_ops(mp.step)
        mp.zero_grad()
        print(f"  loss-scale update {'fused' if fused else 'eager'}: whole step {n_whole} ops, step() {n_step}")


if __name__ == "__main__":
    main()

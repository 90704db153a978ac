"""Accelerate and mixprec: build the engine on the pair Accelerate prepared, then the usual loop.

No integration class is needed. Prepare with ``mixed_precision="no"`` (the recipe is the precision),
build ``MixedPrecision`` on the prepared model and optimizer, and call ``mp.backward(loss)`` where the
loop would call ``accelerator.backward(loss)``. A ``fused=True`` AdamW keeps its fused path through
Accelerate's optimizer wrapper: the unscale, clip and overflow skip run inside its kernel, no host sync::

    python examples/accelerate_train.py                  # fp16, 60 steps
    accelerate launch examples/accelerate_train.py --recipe bf16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import mixprec
from mixprec.integrations.logging import MetricsLogger


def make_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Four classes of 2-D points on interleaved spirals, embedded in 16 dimensions."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 4, (n,), generator=g)
    r = torch.rand(n, generator=g)
    angle = 4 * r + label * (torch.pi / 2) + 0.1 * torch.randn(n, generator=g)
    points = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], 1)       # (N, 2)
    return torch.utils.data.TensorDataset(points @ torch.randn(2, 16, generator=g), label)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fp16", help="a mixprec recipe: fp16, bf16, fp16-pure, bf16-pure, fp8, ...")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[mixprec.MixedPrecision, list[float], list[dict[str, float]]]:
    """Train; returns the engine, the per-step losses and the logged metrics."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    loader = torch.utils.data.DataLoader(make_data(args.steps * args.batch, args.seed), batch_size=args.batch,
                                         shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    mp = mixprec.MixedPrecision(model, optimizer, args.recipe, clip_grad_norm=1.0)   # on the prepared pair
    logged: list[dict[str, float]] = []
    metrics = MetricsLogger(lambda m, step: logged.append(m), every=10)   # or a TensorBoard SummaryWriter
    losses = []
    for step, (x, y) in enumerate(loader):
        with mp.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        mp.backward(loss)              # instead of accelerator.backward(loss)
        metrics.log_step(mp, mp.step(), step)
        mp.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"{args.recipe}: loss {sum(losses[:5]) / 5:.4f} -> {sum(losses[-5:]) / 5:.4f}, "
                      f"loss scale {mp.scale:g}, {mp.skipped_steps} skipped")
    return mp, losses, logged


if __name__ == "__main__":
    main()

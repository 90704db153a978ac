"""Writes the checkpoints in tests/data/ckpt-v2/ (run from the repository root with the mixprec to record):
a short run of the tiny model under a few recipes, through the public API only, so the same script runs
on any mixprec version. tests/test_checkpoint_compat.py loads them and rewrites them bit for bit."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

RECIPES = ("fp16-pure", "bf16-kahan", "bf16-sr", "fp8-delayed")


def run(recipe: str) -> mixprec.MixedPrecision:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 16))
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe, seed=3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g)
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return mp


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for recipe in RECIPES:
        torch.manual_seed(0)
        mixprec.save_checkpoint(out / f"{recipe}.ckpt", run(recipe))

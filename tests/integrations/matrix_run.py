"""One tiny model trained under one recipe from the same weights, on one fixed batch, as its fp32 twin
is: the loss curve and which steps were skipped, for the matrix test and the measurements."""

import time

import torch

import hf_tiny
from mixprec import MixedPrecision


def train_curve(model_name: str, recipe: str, steps: int = 15, lr: float = 3e-3):
    """``(losses, skipped, seconds, model)`` after ``steps`` AdamW steps on one fixed batch.

    ``skipped[i]`` says step i was skipped (non-finite gradients): with one fixed batch a skipped
    step only delays the curve, so it can be compared with fp32's step for step (``aligned``).
    """
    build, _ = hf_tiny.BUILDERS[model_name]
    model, make_batch, loss_of = build(seed=0)
    model.train()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=lr), recipe)
    batch = make_batch(0)
    losses, skipped = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        with mp.autocast():
            loss = loss_of(model, batch)
        mp.backward(loss)
        result = mp.step()
        mp.zero_grad()
        losses.append(float(loss.detach()))
        skipped.append(result.skipped)
    return losses, skipped, time.perf_counter() - t0, model


def aligned_deviation(losses, skipped, ref):
    """Largest difference between a run's loss and fp32's after the same number of updates, relative
    to fp32's initial loss (a loss that falls to ~1e-3, as a memorised batch's does, would make a
    step-by-step relative difference meaningless)."""
    worst, done = 0.0, 0
    for loss, skip in zip(losses, skipped):
        worst = max(worst, abs(loss - ref[done]) / abs(ref[0]))
        done += not skip
    return worst

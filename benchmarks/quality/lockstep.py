"""Lockstep training of a small character GPT: one init and one batch order per seed, for every recipe.

The loop is ``examples/nanogpt_train.py``'s (mixprec's GPT: pre-LN, tied LM head; AdamW 3e-3, betas
(0.9, 0.99), weight decay 0.1 on matrices, 20 warm-up iterations then cosine decay to a tenth, clip 1.0,
batch 32 x 64 characters of CPython's pydoc text), with two changes that make runs comparable: the batch
generator is used for training batches only, and validation is a fixed set of held-out windows (the
same for every recipe and every evaluation), so two recipes at the same seed see exactly the same
data and start from exactly the same weights. ``train_quality.py`` and ``mxfp8_ablation.py`` run it.

    curve = train_lockstep("mxfp8", seed=0, iters=800)     # [(iteration, val loss), ...]

``configure(model)``, called after the engine swapped the fp8 layers, lets an ablation change them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mixprec
from mixprec.lab.models import GPT, GPTConfig
from mixprec.lab.workloads import char_vocab, pydoc_text

__all__ = ["Shape", "train_lockstep", "corpus", "run_jobs"]

_CORPUS: dict[str, torch.Tensor] = {}


class Shape:
    """The model and loop's size; the defaults are nanogpt_train.py's."""

    def __init__(self, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, block: int = 64, batch: int = 32,
                 lr: float = 3e-3, warmup: int = 20, clip: float = 1.0, weight_decay: float = 0.1,
                 val_windows: int = 64) -> None:
        self.n_layer, self.n_head, self.n_embd, self.block, self.batch = n_layer, n_head, n_embd, block, batch
        self.lr, self.warmup, self.clip, self.weight_decay, self.val_windows = lr, warmup, clip, weight_decay, val_windows


def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train ids, val ids, vocabulary size)``: pydoc text, the first 90% for training."""
    if not _CORPUS:
        path = os.environ.get("LOCKSTEP_CORPUS")     # a copy of the text, for a Python without pydoc_data
        text = open(path, encoding="utf-8").read() if path else pydoc_text()
        vocab = char_vocab(text)
        index = {c: i for i, c in enumerate(vocab)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
        n = int(0.9 * len(ids))
        _CORPUS.update(train=ids[:n], val=ids[n:], vocab=torch.tensor(len(vocab)))
    return _CORPUS["train"], _CORPUS["val"], int(_CORPUS["vocab"])


def _lr(it: int, iters: int, s: Shape) -> float:
    if it < s.warmup:
        return s.lr * (it + 1) / s.warmup
    progress = (it - s.warmup) / max(1, iters - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def _val_loss(model: torch.nn.Module, mp: mixprec.MixedPrecision, xv: torch.Tensor, yv: torch.Tensor) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(xv), 32):
        with mp.autocast():
            logits = model(xv[i:i + 32])                                        # (B, T, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), yv[i:i + 32].flatten(), reduction="sum").item()
    model.train()
    return total / yv.numel()


def train_lockstep(recipe: str, *, seed: int, iters: int, shape: Shape | None = None, eval_every: int = 50,
                   device: str = "cpu", configure: Callable[[torch.nn.Module], None] | None = None,
                   on_step: Callable[[int, torch.nn.Module], None] | None = None) -> list[tuple[int, float]]:
    """Train ``iters`` iterations under ``recipe``; the validation loss at 0, every ``eval_every`` and the end.

    ``on_step(it, model)`` runs after each backward, before the optimizer step (gradients in place).
    """
    s = shape or Shape()
    train, val, vocab = corpus()
    # Validation: val_windows windows spread evenly over the held-out text (fixed: the same every time).
    starts = torch.linspace(0, len(val) - s.block - 2, s.val_windows).long()
    xv = torch.stack([val[i:i + s.block] for i in starts.tolist()])
    yv = torch.stack([val[i + 1:i + s.block + 1] for i in starts.tolist()]).to(device)
    xv = xv.to(device)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=s.block, n_layer=s.n_layer, n_head=s.n_head,
                          n_embd=s.n_embd)).to(device)     # built on the CPU: the same init on any device
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.99))
    mp = mixprec.MixedPrecision(model, opt, recipe, clip_grad_norm=s.clip or None)
    if configure is not None:
        configure(model)
    g = torch.Generator().manual_seed(10_000 + seed)      # batches: the same for every recipe
    curve = [(0, _val_loss(model, mp, xv, yv))]
    for it in range(iters):
        for group in opt.param_groups:
            group["lr"] = _lr(it, iters, s)
        ix = torch.randint(len(train) - s.block - 1, (s.batch,), generator=g)
        x = torch.stack([train[i:i + s.block] for i in ix.tolist()])            # (B, T)
        y = torch.stack([train[i + 1:i + s.block + 1] for i in ix.tolist()])
        x, y = x.to(device), y.to(device)
        with mp.autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        mp.backward(loss)
        if on_step is not None:
            on_step(it, model)
        mp.step()
        mp.zero_grad()
        if (it + 1) % eval_every == 0 or it + 1 == iters:
            curve.append((it + 1, _val_loss(model, mp, xv, yv)))
    return curve


def _job(args: tuple) -> dict:
    """One run: ``(kind, label, recipe, seed, iters, eval_every, device[, Shape kwargs])``; kind "recipe"
    or "variant"."""
    kind, label, recipe, seed, iters, eval_every, device = args[:7]
    shape = Shape(**args[7]) if len(args) > 7 else None
    torch.set_num_threads(1)
    import warnings
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    configure = None
    if kind == "variant":                          # an ablation's variant (mxfp8_ablation.VARIANTS)
        from mxfp8_ablation import configure_variant
        configure = configure_variant(label)
    curve = train_lockstep(recipe, seed=seed, iters=iters, eval_every=eval_every, device=device,
                           configure=configure, shape=shape)
    return {"kind": kind, "label": label, "recipe": recipe, "seed": seed, "iters": iters,
            "seconds": round(time.perf_counter() - t0, 1), "curve": curve}


def run_jobs(jobs: list[tuple], workers: int, out: str | None) -> list[dict]:
    """Run ``_job`` tuples in ``workers`` spawned processes (one thread each); JSON lines to ``out``."""
    import multiprocessing as mp
    results = []
    fh = open(out, "a") if out else None
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, maxtasksperchild=1) as pool:
        for r in pool.imap_unordered(_job, jobs):
            results.append(r)
            line = json.dumps(r)
            print(f"{r['label']:>24} seed {r['seed']} {r['seconds']:>6.1f}s  "
                  + " ".join(f"{it}:{v:.3f}" for it, v in r["curve"][-5:]), flush=True)
            if fh:
                fh.write(line + "\n")
                fh.flush()
    return results

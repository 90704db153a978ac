"""Train a character-level GPT under a mixprec recipe: a nanoGPT-style loop, read top to bottom.

The model is mixprec's own decoder (``mixprec.lab.models.GPT``: pre-LN blocks, tied LM head); the
text is CPython's pydoc topics (~465k characters, shipped with every CPython). Four lines make the
loop mixed precision: the engine, ``mp.autocast()`` around the forward, ``mp.backward(loss)`` and
``mp.step()``, which unscales, clips, skips overflowing steps and updates the loss scale::

    python examples/nanogpt_train.py                      # bf16, 300 iterations
    python examples/nanogpt_train.py --recipe fp16 --iters 1000 --n-layer 4 --n-embd 128
    python examples/nanogpt_train.py --recipe fp32        # the reference to compare against

It prints the train and validation loss (nats per character) every ``--eval-interval`` iterations.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import mixprec
from mixprec.devices import resolve_device
from mixprec.lab.models import GPT, GPTConfig


def load_text() -> str:
    from pydoc_data.topics import topics        # what help("if") prints, for every topic
    return "\n".join(topics[key] for key in sorted(topics))


def get_batch(data: torch.Tensor, block: int, batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``block`` characters and the same windows shifted by one."""
    starts = torch.randint(len(data) - block - 1, (batch,), generator=g)
    x = torch.stack([data[i:i + block] for i in starts.tolist()])             # (B, T)
    y = torch.stack([data[i + 1:i + block + 1] for i in starts.tolist()])     # (B, T)
    return x, y


def lr_at(it: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then a cosine decay to a tenth of the peak."""
    if it < args.warmup:
        return args.lr * (it + 1) / args.warmup
    progress = (it - args.warmup) / max(1, args.iters - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def estimate_loss(model, mp, splits, args, g) -> dict[str, float]:
    model.eval()
    out = {}
    for name, data in splits.items():
        losses = []
        for _ in range(args.eval_iters):
            x, y = get_batch(data, args.block, args.batch, g)
            x, y = x.to(mp.device), y.to(mp.device)
            with mp.autocast():
                logits = model(x)                                        # (B, T, V)
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
        out[name] = sum(losses) / len(losses)
    model.train()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="bf16", help="a mixprec recipe: fp32, bf16, fp16, bf16-pure, fp8, ...")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block", type=int, default=64, help="context length T")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; returns the last evaluation ({"train": ..., "val": ...}) and the skipped steps."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    text = load_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)      # (L,) token ids
    n = int(0.9 * len(ids))
    splits = {"train": ids[:n], "val": ids[n:]}

    config = GPTConfig(vocab_size=len(vocab), block_size=args.block, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]     # matrices decay, biases and norms do not
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.99))
    mp = mixprec.MixedPrecision(model, optimizer, args.recipe, clip_grad_norm=args.clip)

    losses: dict[str, float] = {}
    t0 = time.perf_counter()
    for it in range(args.iters + 1):
        if it % args.eval_interval == 0 or it == args.iters:
            losses = estimate_loss(model, mp, splits, args, g)
            print(f"iter {it:5d}: train {losses['train']:.4f}, val {losses['val']:.4f}, "
                  f"loss scale {mp.scale:g}, {time.perf_counter() - t0:.1f} s")
        if it == args.iters:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it, args)
        x, y = get_batch(splits["train"], args.block, args.batch, g)
        x, y = x.to(device), y.to(device)
        with mp.autocast():
            logits = model(x)                                           # (B, T, V) in the compute dtype
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # the loss in fp32
        mp.backward(loss)          # (loss * S).backward(): S is the loss scale (1 without one)
        mp.step()                  # unscale, clip, skip on inf/NaN, update S
        mp.zero_grad()
    return {**losses, "skipped_steps": float(mp.skipped_steps)}


if __name__ == "__main__":
    main()

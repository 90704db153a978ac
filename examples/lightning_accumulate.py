"""Lightning with gradient accumulation under a mixprec recipe: a small MLP learns a noisy mapping.

``MixedPrecisionPlugin`` takes Lightning's precision-specific parts; the engine exists from the first
micro-batch, so with ``accumulate_grad_batches=k`` every micro-batch of every step carries the loss
scale and the recipe's casts (the loop equals the engine driven by hand bit for bit: the tests)::

    python examples/lightning_accumulate.py                         # fp16, accumulate 4
    python examples/lightning_accumulate.py --recipe bf16-pure --accumulate 8 --steps 100
"""

from __future__ import annotations

import argparse
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.integrations.lightning import MixedPrecisionPlugin
from mixprec.integrations.logging import MetricsLogger


class Regressor(L.LightningModule):
    def __init__(self, d_in: int = 32, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).float().squeeze(-1), y)     # the loss in fp32
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def make_data(n: int, d_in: int, seed: int) -> torch.utils.data.TensorDataset:
    """y = sin(x . w) + noise: smooth, learnable, not linear."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, generator=g) / d_in ** 0.5
    return torch.utils.data.TensorDataset(x, torch.sin(2 * x @ w) + 0.05 * torch.randn(n, generator=g))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fp16", help="a mixprec recipe: fp16, bf16, fp16-pure, bf16-pure, fp8, ...")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=4, help="accumulate_grad_batches")
    p.add_argument("--batch", type=int, default=16, help="samples per micro-batch")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[Regressor, MixedPrecisionPlugin, list[dict[str, float]]]:
    """Train; returns the module (its per-micro-batch losses), the plugin and the logged step metrics."""
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    data = make_data(args.steps * args.accumulate * args.batch, 32, args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    logged: list[dict[str, float]] = []
    plugin = MixedPrecisionPlugin(args.recipe, metrics=MetricsLogger(lambda m, step: logged.append(m)))
    trainer = L.Trainer(max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0,
                        plugins=[plugin], accelerator="auto", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tempfile.mkdtemp(prefix="mixprec-lightning-"))
    module = Regressor()
    trainer.fit(module, loader)
    first, last = module.losses[:args.accumulate], module.losses[-args.accumulate:]
    print(f"{args.recipe}: loss {sum(first) / len(first):.4f} -> {sum(last) / len(last):.4f} over "
          f"{trainer.global_step} steps of {args.accumulate} micro-batches; loss scale {plugin.engine.scale:g}, "
          f"{plugin.engine.skipped_steps} skipped")
    return module, plugin, logged


if __name__ == "__main__":
    main()

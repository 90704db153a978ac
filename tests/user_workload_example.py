"""An example of your own workload for ``mixprec compare --workload user_workload_example:tiny``.

A function that takes no arguments and returns a dict: the model, the data as a ``Split``, the loss and
a function that builds the optimizer from the parameters. Run it from this directory (or put the module
on PYTHONPATH): ``mixprec compare --workload user_workload_example:tiny --steps 200``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.lab.workloads import Split


def _blobs(n: int = 600, features: int = 16, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random points labelled by a fixed random linear rule: learnable, from a private generator."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)                 # (N, F) float32
    w = torch.randn(features, classes, generator=g)
    return x, (x @ w).argmax(dim=1)                           # (N,) int64 labels


def tiny() -> dict:
    """The least you return: model, data, loss, optimizer. The metric defaults to accuracy."""
    x, y = _blobs()
    return {
        "model": nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3)),
        "data": Split(x[:500], y[:500], x[500:], y[500:]),    # train inputs, targets; test ones
        "loss": F.cross_entropy,                              # loss(outputs, targets) -> scalar tensor
        "optimizer": lambda params: torch.optim.AdamW(params, lr=1e-2),
    }


def tiny_seeded() -> dict:
    """The same, with a model *function* (called under --seed for every run) and the optional keys."""
    return {**tiny(),
            "model": lambda: nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 3)),
            "batch_size": 32, "steps": 200, "summary": "a LayerNorm MLP on three linear blobs"}

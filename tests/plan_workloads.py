"""Small workloads for ``mixprec plan``'s tests: ``--workload plan_workloads:wide`` from this directory.

``wide``: an MLP regression whose layers are wide enough that fp8 pays on a real target (1024 rows,
widths 512-1024), for the by-hand run and the slow CLI test. ``tiny``: the same shape of problem at a
size the default suite trains in a second. ``nowhere``: no layer the plan can take (dims not multiples
of 16). ``diverges``: a learning rate fp32 does not survive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.lab.workload import Split


def _data(n: int, features: int, outputs: int) -> Split:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, outputs, generator=g) / features ** 0.5
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, outputs, generator=g)
    cut = n * 7 // 8
    return Split(x[:cut], y[:cut], x[cut:], y[cut:])


def _mlp(widths: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _workload(widths: tuple[int, ...], n: int, batch: int, lr: float = 1e-3) -> dict:
    data = _data(n, widths[0], widths[-1])
    return {"model": lambda: _mlp(widths), "data": data, "loss": F.mse_loss,
            "optimizer": lambda params: torch.optim.AdamW(params, lr=lr),
            "metric": lambda out, y: float(F.mse_loss(out, y)), "metric_name": "mse", "higher_is_better": False,
            "batch_size": batch, "steps": 40}


def tiny() -> dict:
    return _workload((32, 64, 64, 16), n=512, batch=64)


def wide() -> dict:
    return _workload((512, 1024, 1024, 512), n=4096, batch=1024)


def nowhere() -> dict:
    return _workload((30, 50, 10), n=256, batch=32)


def diverges() -> dict:
    return _workload((32, 64, 16), n=256, batch=32, lr=1e6)

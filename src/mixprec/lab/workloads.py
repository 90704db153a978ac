"""Built-in workloads: a model, its data, its loss, its optimizer and how to score it, as one frozen value.

A workload is everything the trainer needs to train one model the same way under every recipe. Data is
loaded when asked for (never at import) and cached for the process; the train/test split is fixed, so
accuracies compare across seeds and recipes::

    >>> w = get_workload("mlp")
    >>> data = w.load_data()
    >>> tuple(data.x_train.shape), tuple(data.x_test.shape)
    ((1437, 64), (360, 64))
    >>> get_workload("resnet")
    Traceback (most recent call last):
    ValueError: unknown workload 'resnet'; valid workloads: mlp
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Split", "Workload", "WORKLOADS", "get_workload", "accuracy"]


@dataclasses.dataclass(frozen=True)
class Split:
    """Train and test tensors: inputs float32, targets int64 class indices."""

    x_train: torch.Tensor   # (N_train, ...) float32
    y_train: torch.Tensor   # (N_train,) int64
    x_test: torch.Tensor    # (N_test, ...) float32
    y_test: torch.Tensor    # (N_test,) int64

    def to(self, device: torch.device | str) -> Split:
        """The same split on ``device`` (the built-in data sets are small enough to live there whole)."""
        return Split(*(t.to(device) for t in (self.x_train, self.y_train, self.x_test, self.y_test)))


@dataclasses.dataclass(frozen=True)
class Workload:
    """One trainable task, defined once so every recipe trains it identically.

    ``build_model`` must draw its initial weights from torch's global generator only, so seeding that
    generator before the call fixes them. ``make_optimizer`` takes the model's parameters.
    ``metric(outputs, targets)`` scores the test set (higher is better); ``metric_name`` labels it.
    """

    name: str
    summary: str
    build_model: Callable[[], nn.Module]
    load_data: Callable[[], Split]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    metric: Callable[[torch.Tensor, torch.Tensor], float]
    metric_name: str
    batch_size: int
    default_steps: int

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.default_steps < 1:
            raise ValueError(f"workload {self.name!r} needs batch_size and default_steps >= 1, got "
                             f"{self.batch_size} and {self.default_steps}")


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The fraction of rows whose largest logit is the target class. Syncs with the host."""
    return float((logits.argmax(dim=-1) == targets).float().mean())


# ----------------------------------------------------------------------------------------- mlp
# The seed's 2-layer MLP (seed 002 trains one on MNIST), on the 8x8 digits that ship with
# scikit-learn: 1797 real handwritten digits, no download.

_DIGITS_FEATURES = 64      # 8x8 pixels
_DIGITS_CLASSES = 10
_DIGITS_MAX_PIXEL = 16.0   # pixel values are integers 0..16
_MLP_HIDDEN = 256
_SPLIT_SEED = 0            # fixed: the test set is the same whatever --seed says


@functools.cache
def _digits() -> Split:
    # Imported here: scikit-learn is slow to import and only this loader needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / _DIGITS_MAX_PIXEL).astype(np.float32)   # [0, 1]: exact in fp16 and bf16 (k/16)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=_SPLIT_SEED)
    return Split(torch.from_numpy(x_train), torch.from_numpy(y_train),
                 torch.from_numpy(x_test), torch.from_numpy(y_test))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(_DIGITS_FEATURES, _MLP_HIDDEN), nn.ReLU(),
                         nn.Linear(_MLP_HIDDEN, _DIGITS_CLASSES))


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-4)


MLP = Workload(
    name="mlp",
    summary=f"2-layer MLP ({_DIGITS_FEATURES}-{_MLP_HIDDEN}-{_DIGITS_CLASSES}, ReLU) on scikit-learn's "
            "8x8 handwritten digits (1437 train / 360 test)",
    build_model=_mlp,
    load_data=_digits,
    loss_fn=F.cross_entropy,
    make_optimizer=_adamw,
    metric=accuracy,
    metric_name="accuracy",
    batch_size=64,
    default_steps=500,
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (MLP,)}


def get_workload(name: str) -> Workload:
    """The built-in workload called ``name``; an unknown name lists the valid ones."""
    if not isinstance(name, str):
        raise TypeError(f"workload must be a name such as 'mlp', got {type(name).__name__}")
    try:
        return WORKLOADS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}") from None

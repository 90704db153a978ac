"""What a workload is: ``Workload`` (one trainable task: model, data, loss, optimizer, metric) and
``Split`` (its train and test tensors), with the metrics the built-in ones use.

Kept apart from ``workloads`` (the built-in workloads and the lookup by name) so that a user's own
workload (``user_workloads``) needs the types alone, and the lookup can load it without a cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..casting.chunked_loss import cross_entropy as chunked_cross_entropy

__all__ = ["Split", "Workload", "accuracy", "cross_entropy", "mean_cross_entropy"]


@dataclasses.dataclass(frozen=True)
class Split:
    """Train and test tensors, rows aligned: the trainer draws minibatches by indexing rows.

    Inputs are float32 features or images, or int64 token ids (mixprec casts floating inputs only, so
    token ids stay int64 under every recipe); targets are int64 class indices, or next-token ids.
    """

    x_train: torch.Tensor   # (N_train, ...) float32, or (N_train, T) int64 token ids
    y_train: torch.Tensor   # (N_train,) int64, or (N_train, T) int64
    x_test: torch.Tensor    # (N_test, ...)
    y_test: torch.Tensor    # (N_test, ...)

    def __post_init__(self) -> None:
        for name in ("x_train", "y_train", "x_test", "y_test"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"Split.{name} must be a torch.Tensor, got {type(value).__name__}; "
                                f"convert it, e.g. torch.as_tensor({name})")
        for part in ("train", "test"):
            x, y = getattr(self, f"x_{part}"), getattr(self, f"y_{part}")
            if x.dim() == 0 or y.dim() == 0 or len(x) != len(y) or len(x) == 0:
                raise ValueError(f"Split.x_{part} and y_{part} must hold the same number of rows (>= 1), "
                                 f"one per sample; got shapes {tuple(x.shape)} and {tuple(y.shape)}")

    def to(self, device: torch.device | str) -> Split:
        """The same split on ``device`` (the built-in data sets are small enough to live there whole)."""
        return Split(*(t.to(device) for t in (self.x_train, self.y_train, self.x_test, self.y_test)))


@dataclasses.dataclass(frozen=True)
class Workload:
    """One trainable task, defined once so every recipe trains it identically.

    ``build_model`` must draw its initial weights from torch's global generator only, so seeding that
    generator before the call fixes them. ``make_optimizer`` takes the model's parameters.
    ``metric(outputs, targets)`` scores the test set, ``metric_name`` labels it and ``higher_is_better``
    says which way is good (accuracy: True; a loss: False). ``tokens_per_sample`` is T for a language
    model (tokens/s = samples/s * T), 0 otherwise. ``synthetic`` marks random data: a speed benchmark
    whose metric only shows that the numbers stayed finite.
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
    higher_is_better: bool = True
    tokens_per_sample: int = 0
    synthetic: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.default_steps < 1:
            raise ValueError(f"workload {self.name!r} needs batch_size and default_steps >= 1, got "
                             f"{self.batch_size} and {self.default_steps}")
        if self.tokens_per_sample < 0:
            raise ValueError(f"workload {self.name!r}: tokens_per_sample must be >= 0 (0: not a language "
                             f"model), got {self.tokens_per_sample}")


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The fraction of rows whose largest logit is the target class. Syncs with the host."""
    return float((logits.argmax(dim=-1) == targets).float().mean())


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) over every position: ``(..., V)`` logits against ``(...)`` targets.

    ``(B, V)`` class logits and ``(B, T, V)`` next-token logits alike: the leading dimensions are
    flattened, so each token counts once. Computed in fp32 chunk by chunk from the logits as they come
    (:func:`mixprec.cross_entropy`): no full fp32 copy of a language model's logits is saved.
    """
    return chunked_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """``cross_entropy`` as a metric (lower is better; exp of it is the perplexity). Syncs with the host."""
    return float(cross_entropy(logits.float(), targets))

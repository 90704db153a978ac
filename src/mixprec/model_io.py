"""What goes into a model and what comes out, for the models people train.

Plain PyTorch models take a tensor and return one. Hugging Face models take keyword batches
(``input_ids=..., attention_mask=..., labels=...``) and return a ``ModelOutput``: a dataclass that is
also an ordered dict, with ``logits`` and, when labels were given, ``loss``. The tools that drive a
model for the user (``memory_report``, the lab's trainer and evaluation) accept both through these
three functions::

    >>> import torch
    >>> out = {"loss": torch.tensor(2.0), "logits": torch.zeros(1, 3)}
    >>> output_logits(out).shape, float(output_loss(out))
    (torch.Size([1, 3]), 2.0)
    >>> output_loss(torch.zeros(3)) is None
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["call_model", "output_logits", "output_loss", "predictions"]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping (a dict batch, an HF ``BatchEncoding``), ``model(*inputs)``
    for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _field(out: Any, name: str) -> Any:
    if isinstance(out, Mapping):
        return out.get(name)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return getattr(out, name, None)
    return None


def output_logits(out: Any) -> torch.Tensor:
    """The tensor of predictions in a model's output: the output itself when it is a tensor, else its
    ``logits`` (a dict, or a dataclass such as HF's ``ModelOutput``). TypeError, naming what was
    found, for anything else."""
    if isinstance(out, torch.Tensor):
        return out
    logits = _field(out, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    keys = list(out.keys()) if isinstance(out, Mapping) else (
        [f.name for f in dataclasses.fields(out)] if dataclasses.is_dataclass(out) else None)
    raise TypeError(f"the model returned {type(out).__name__}" + (f" with fields {keys}" if keys else "")
                    + "; expected a tensor, or a dict/dataclass with a 'logits' tensor (as Hugging Face "
                    "models return): make forward return the predictions")


def output_loss(out: Any) -> torch.Tensor | None:
    """The ``loss`` a model computed itself (HF models do when given labels), or None."""
    loss = _field(out, "loss")
    return loss if isinstance(loss, torch.Tensor) else None


def predictions(out: Any) -> Any:
    """The ``logits`` of a dict/dataclass output that has them; any other output as it is (a tensor,
    or a tuple a user's loss function unpacks itself)."""
    logits = None if isinstance(out, torch.Tensor) else _field(out, "logits")
    return logits if isinstance(logits, torch.Tensor) else out

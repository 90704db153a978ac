"""Shadow copies: a model and its batch with the same shapes and dtypes but no memory behind them.

Tracing a training step for its shapes (tensor cores) or its bytes (memory) needs no values. A shadow
copy shares nothing with the original: the module tree is deep-copied, and every parameter and buffer is
replaced by an empty tensor of the same shape, dtype, stride and ``requires_grad`` on the ``meta``
device, or, inside a ``FakeTensorMode``, a fake CPU tensor (which autocast accepts: ``meta`` has no
autocast). Tied weights stay tied::

    with torch.device("meta"):
        big = build_model()              # never allocated
    shadow = meta_copy(big)              # or meta_copy(real_model): the real one is left alone
    x = meta_like(batch)

Raises ValueError, with the reason, for a model that cannot be deep-copied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["meta_copy", "meta_like", "shadow_copy"]


def _empty_like(t: torch.Tensor, device: str) -> torch.Tensor:
    # empty_strided keeps the layout (channels-last weights stay channels-last) and allocates nothing
    # on meta or under FakeTensorMode.
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def shadow_copy(model: nn.Module, device: str = "meta") -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are empty ``device`` tensors.

    Call it inside a ``FakeTensorMode`` with ``device="cpu"`` for fake CPU tensors.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_empty_like(p, device), requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = _empty_like(b, device)
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:   # arbitrary user objects inside the module: say which and why
        raise ValueError(f"cannot make a memory-free copy of {type(model).__name__} to trace it "
                         f"({type(e).__name__}: {e}); make the model deep-copyable") from None


def meta_copy(model: nn.Module) -> nn.Module:
    """``shadow_copy`` on the meta device."""
    return shadow_copy(model, "meta")


def meta_like(value: Any, device: str = "meta") -> Any:
    """Every tensor in a nest of tuples, lists and dicts as an empty ``device`` tensor of its shape.

    ``requires_grad`` carries over: an input that needs a gradient adds a matmul to the backward. A
    tensor that appears twice (the same token ids as inputs and targets) maps to one empty tensor, so
    memory counts see one storage, as they would for the real batch.
    """
    made: dict[int, torch.Tensor] = {}

    def empty(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in made:
            made[id(t)] = _empty_like(t, device).requires_grad_(t.requires_grad and t.is_floating_point())
        return made[id(t)]
    return tree_map(empty, value)

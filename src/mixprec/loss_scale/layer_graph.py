"""The layers of per-layer loss scaling (``loss_scale/per_layer.py``), and the proof that a model's graph suits them.

A *layer* is a module that owns trainable parameters directly and has no descendant that does; modules
sharing a parameter (a tied embedding and head) form one. ``find_layers`` lists them; ``check_graph``
walks the first backward's autograd graph once and refuses a model whose gradients would mix the global
scale S and a layer's S*r (a parameter used outside its module's forward, a tensor made inside a layer
used outside it by another path than the layer's outputs); a layer whose outputs feed each other raises
``OutputsFeedEachOther``, which ``layer_scale`` answers by keeping that layer at S. The rest are helpers
the forward hooks use to find the tensors in a module's inputs and outputs.

    >>> [layer.name for layer in find_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)))]
    ['0', '2']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Layer", "find_layers", "check_graph", "OutputsFeedEachOther", "made_at", "tensors_in", "map_tensors"]


class OutputsFeedEachOther(ValueError):
    """A layer uses one of its own outputs inside its forward to make another output (HF Mixtral's router
    returns its logits and the top-k weights computed from them). The output's gradient then sums what
    comes back from the parent (at S) and from inside the layer (at S*r) before the factor at that output
    applies: no factor r but 1 scales that layer exactly. ``layer``: its index."""

    def __init__(self, layer: int, message: str) -> None:
        super().__init__(message)
        self.layer = layer


@dataclasses.dataclass(frozen=True)
class Layer:
    """One scaled region: modules that own trainable parameters directly (several when they share one)."""

    name: str                        # qualified names joined by '+', e.g. 'wte+lm_head'
    modules: tuple[nn.Module, ...]
    params: tuple[nn.Parameter, ...]


def find_layers(model: nn.Module) -> list[Layer]:
    """The layers of ``model`` in module order: leaf owners of trainable parameters, tied ones merged.

    A module that owns parameters and also has parameter-owning descendants (``nn.MultiheadAttention``'s
    ``in_proj_weight``) is not a layer: its region would contain other layers' and scale them twice.
    Its own parameters train at S alone.
    """
    owners: list[tuple[str, nn.Module, list[nn.Parameter]]] = []
    for name, module in model.named_modules():
        direct = [p for p in module.parameters(recurse=False) if p.requires_grad]
        nested = any(p.requires_grad for m in module.modules() if m is not module
                     for p in m.parameters(recurse=False))
        if direct and not nested:
            owners.append((name or "<model>", module, direct))
    parent = list(range(len(owners)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[int, int] = {}
    for i, (_, _, direct) in enumerate(owners):
        for p in direct:
            parent[root(i)] = root(first.setdefault(id(p), i))
    groups: dict[int, list[int]] = {}
    for i in range(len(owners)):
        groups.setdefault(root(i), []).append(i)
    layers = []
    for members in sorted(groups.values()):
        params = {id(p): p for i in members for p in owners[i][2]}
        layers.append(Layer("+".join(owners[i][0] for i in members), tuple(owners[i][1] for i in members),
                            tuple(params.values())))
    return layers


def check_graph(root: Any, enter: dict[tuple[Any, int], int], leave: dict[Any, int],
                expected: Callable[[torch.Tensor], tuple[int, ...] | None],
                describe: Callable[[tuple[int, ...], torch.Tensor | None], str]) -> None:
    """Prove that every gradient path from ``root`` crosses the layers' marks consistently; else ValueError.

    Each node of the backward graph gets the stack of layers its gradient is inside: an ``enter`` edge
    (a layer's output) pushes one, a ``leave`` node (its input's view) pops it. The gradients summed at
    a node must all carry the same stack (else they were at different scales: S and S*r), a leave node
    must pop the layer it belongs to, and a parameter's gradient must arrive with its own layer's stack
    (``expected``). Host-only: walks the graph's nodes, reads no tensor.
    """
    seen: dict[Any, tuple[int, ...]] = {}
    stack: list[tuple[Any, tuple[int, ...]]] = [(root, ())]
    while stack:
        node, marks = stack.pop()
        if node in seen:
            if seen[node] != marks:
                raise ValueError(_refusal(f"gradients meet at {node.name()} from {describe(seen[node], None)} "
                                          f"and from {describe(marks, None)}: a tensor made inside a layer is "
                                          "used outside it by another path than the layer's outputs"))
            continue
        seen[node] = marks
        if node in leave:
            if not marks or marks[-1] != leave[node]:
                raise ValueError(_refusal(f"the gradient leaves {describe((leave[node],), None)} from "
                                          f"{describe(marks, None)}: layers are nested or called out of order"))
            marks = marks[:-1]
        variable = getattr(node, "variable", None)     # an AccumulateGrad node: a leaf tensor
        want = expected(variable) if variable is not None else None
        if want is not None and marks != want:
            raise ValueError(_refusal(f"{describe(marks, variable)}, but it belongs to "
                                      f"{describe(want, None)}: a parameter used outside its module's forward "
                                      "(e.g. F.linear(x, self.wte.weight) in a parent module) mixes scales"))
        for nxt, nr in node.next_functions:
            if nxt is not None:
                i = enter.get((nxt, nr))
                if i is not None and marks and marks[-1] == i:
                    raise OutputsFeedEachOther(i, _refusal(
                        f"{describe((i,), None)} uses a tensor it returns (made by {nxt.name()}) inside its "
                        "own forward to make another of its outputs, so that tensor's gradient would sum a "
                        "part at S (from the parent) and a part at S*r (from inside the layer)"))
                stack.append((nxt, marks if i is None else marks + (i,)))


def _refusal(what: str) -> str:
    return (f"scale=per-layer cannot scale this model: {what}. Call each parameter's module to use it, "
            "or train this model with scale=dynamic")


def made_at(outside: set[int], t: torch.Tensor) -> torch.Tensor:
    """The tensor to hook for output ``t``: its base if ``t`` is a view of a tensor made inside the layer
    (not an input, a base of one, or a parameter), else ``t``."""
    base = t._base
    if base is None or id(base) in outside or base.grad_fn is None:
        return t
    return base


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``: itself, or inside tuples, lists and dicts (nested)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return [t for item in items for t in tensors_in(item)]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to each float tensor in it (tuples, named tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        items = [map_tensors(fn, item) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(fn, item) for item in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj

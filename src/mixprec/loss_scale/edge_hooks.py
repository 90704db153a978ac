"""The hooks at a layer's edges that give ``scale=per-layer`` (per_layer.py) its factor r inside each layer.

A layer's region of the autograd graph is marked in its forward: a pre-hook hands each input that needs a
gradient in as a view of its own, and a forward hook takes hold of each output. In backward the gradient
*entering* the layer (at an output) is multiplied by r and the gradient *leaving* it (at an input's view)
divided by r, so its weight gradients are computed at S*r and nothing outside the layer changes; r and
1/r are powers of two in [1, 2**15], both exact in fp16. Each gradient hook also notes the largest
|gradient| it saw (``_note_peak``: one aminmax read), in place, into the step's statistics.

``LayerEdgeHooks`` holds these four hooks as methods of ``LayerLossScale``, which installs them
(``attach``) and owns the state they read and write, named here with its type. While the graph is being
recorded for ``check_graph`` (the first backward), the hooks also note which autograd node each mark
sits on (``_enter``, ``_leave``). No host sync; under ``torch.compile`` the traced hooks mark nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .layer_graph import made_at, map_tensors, tensors_in

__all__ = ["LayerEdgeHooks"]


class LayerEdgeHooks:
    """The forward and gradient hooks of ``LayerLossScale`` at each layer's edges (see the module docstring).

    ``i`` is the layer's index; the hooks are bound with ``functools.partial(self._hook, i)``.
    """

    # Owned and sized by LayerLossScale (loss_scale/per_layer.py); read and written in place here.
    _recording: bool                        # until the first step: graph marks for check_graph
    _enter: dict[tuple[Any, int], int]      # (grad_fn, output_nr) of an output -> its layer
    _leave: dict[Any, int]                  # grad_fn of an input's view -> its layer
    _in_acc: torch.Tensor                   # (L,) largest |gradient| entering each layer, at S (-1: none)
    _out_acc: torch.Tensor                  # (L,) largest |gradient| leaving it, at S*r
    _factor_of: list[torch.Tensor]          # 0-d views of r, one per layer
    _inverse_of: list[torch.Tensor]         # 0-d views of 1/r

    def _wrap_inputs(self, i: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Forward pre-hook: each input that needs a gradient goes in as a view whose gradient hook
        divides by r, so the gradient leaves the layer at S again."""
        if not torch.is_grad_enabled():
            return None
        record = self._recording and not torch.compiler.is_compiling()
        changed = False

        def wrap(t: torch.Tensor) -> torch.Tensor:
            nonlocal changed
            if not t.requires_grad:
                return t
            changed = True
            view = t.view_as(t)      # a node of its own: only this layer's use of t is divided
            view.register_hook(functools.partial(self._leaving, i))
            if record:
                self._leave[view.grad_fn] = i
            return view

        args, kwargs = map_tensors(wrap, args), map_tensors(wrap, kwargs)
        return (args, kwargs) if changed else None

    def _hook_outputs(self, i: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook: the gradient of each output is multiplied by r before the layer's backward
        reads it. A tensor hook stays with the op that made the tensor when the output is later
        modified in place (ReLU(inplace=True)); but an in-place op on a *view* (a Linear's output for
        3-D input is one) reroutes the graph around the view's node, so a view made inside the layer
        is hooked at its base instead."""
        if not torch.is_grad_enabled():
            return
        compiling = torch.compiler.is_compiling()    # a traced graph has no grad_fn or _base to read
        outputs = {id(t): t for t in tensors_in(output) if t.requires_grad}    # each once, even if repeated
        if not compiling:
            inputs = tensors_in((args, kwargs))
            outside = {id(a) for a in inputs} | {id(a._base) for a in inputs if a._base is not None}
            outputs = {id(t): t for t in map(functools.partial(made_at, outside), outputs.values())
                       if t.grad_fn is not None}                     # a leaf is not ours to scale
        for t in outputs.values():
            t.register_hook(functools.partial(self._entering, i))
            if self._recording and not compiling:
                self._enter[(t.grad_fn, t.output_nr)] = i

    def _entering(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        _note_peak(self._in_acc, i, grad)
        return grad * self._factor_of[i]       # exact: a power of two, fp16-representable

    def _leaving(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        _note_peak(self._out_acc, i, grad)
        return grad * self._inverse_of[i]


def _note_peak(acc: torch.Tensor, i: int, grad: torch.Tensor) -> None:
    """``acc[i] = max(acc[i], max |grad|)``, in place and outside autograd."""
    with torch.no_grad():
        acc[i] = torch.maximum(acc[i], _amax(grad))


def _amax(grad: torch.Tensor) -> torch.Tensor:
    """max |grad| as a () fp32 tensor; inf or NaN where grad holds one. One reading pass (aminmax)."""
    if grad.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=grad.device)
    low, high = torch.aminmax(grad)
    return torch.maximum(high, -low).float()

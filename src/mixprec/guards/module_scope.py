"""Which module is running: by a stack in the forward, by autograd node creation order in the backward.

Tracers that watch aten ops (the NaN/Inf tracer, the tensor-core tracer) need to say which module an op
belongs to. In the forward that is the innermost module whose ``forward`` is running. In the backward
no module is running: the autograd engine runs *nodes*, recorded in the forward. Every node gets a
sequence number from a thread-local counter when it is created, so a node belongs to the innermost
module that was running when its number was handed out. The forward hooks here note, at each module
entry and exit, the counter's value (read by creating one tiny view node: there is no public peek),
and ``owner(node)`` finds the interval the node's number falls in::

    scope = ModuleScope(model)          # installs a forward pre-hook and hook on every module
    out = model(x)                      # scope.current() is the running module's qualified name
    ...                                 # in the backward: scope.owner(torch._C._current_autograd_node())
    scope.remove()

Names are qualified names from ``model.named_modules()``; the model itself is ``(model)``, ops outside
any module (the loss) are ``(outside the model)``, autograd's gradient accumulation into ``.grad`` is
``(grad accumulation)``. Single-threaded forwards only (the counter is per thread). No host sync.
"""

from __future__ import annotations

import bisect
import functools

import torch
from torch import nn

__all__ = ["ModuleScope", "MODEL", "OUTSIDE", "ACCUMULATE"]

MODEL = "(model)"
OUTSIDE = "(outside the model)"
ACCUMULATE = "(grad accumulation)"

# AccumulateGrad nodes carry UINT64_MAX as their sequence number: they are made per leaf, not per op.
_NO_SEQUENCE = 2**64 - 1


class ModuleScope:
    """Forward hooks on every module of ``model`` that track the running module, forward and backward.

    Cost: two Python hooks per module call, each creating one empty view (a few microseconds).
    """

    def __init__(self, model: nn.Module) -> None:
        self._stack: list[str] = []
        # (sequence number, innermost module from that number on), in increasing numbers.
        self._seq: list[int] = []
        self._names: list[str] = []
        self._probe = torch.empty(0, requires_grad=True)   # a leaf to take views of: no memory
        self._handles = []
        for name, module in model.named_modules():
            label = name or MODEL
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, label)))
            self._handles.append(module.register_forward_hook(functools.partial(self._exit, label),
                                                              always_call=True))

    def current(self) -> str:
        """The innermost module whose forward is running, or ``(outside the model)``."""
        return self._stack[-1] if self._stack else OUTSIDE

    def owner(self, node: torch.autograd.graph.Node | None) -> str:
        """The module whose forward created autograd ``node`` (``None``: outside any node)."""
        if node is None:
            return OUTSIDE
        seq = node._sequence_nr()
        if seq == _NO_SEQUENCE:
            return ACCUMULATE
        i = bisect.bisect_right(self._seq, seq) - 1
        return self._names[i] if i >= 0 else OUTSIDE

    def clear(self) -> None:
        """Forget the recorded intervals (call once the backward of every traced forward has run)."""
        self._seq.clear()
        self._names.clear()

    def remove(self) -> None:
        """Remove every hook this scope installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------------------------ hooks
    def _next_sequence_nr(self) -> int | None:
        # Creating a node takes the next number; the nodes created after it get larger ones. Under
        # no_grad/inference no node is made, and no backward will need the interval either.
        with torch.enable_grad():
            node = self._probe.view(0).grad_fn
        return None if node is None else node._sequence_nr()

    def _mark(self) -> None:
        seq = self._next_sequence_nr()
        if seq is not None:
            self._seq.append(seq)
            self._names.append(self.current())

    def _enter(self, label: str, module: nn.Module, args: tuple) -> None:
        self._stack.append(label)
        self._mark()

    def _exit(self, label: str, module: nn.Module, args: tuple, output: object) -> None:
        if self._stack and self._stack[-1] == label:
            self._stack.pop()
        self._mark()

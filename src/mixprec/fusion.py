"""Small hot functions fused by torch's own compiler in eager mode, with an eager fallback.

A function of a dozen tiny elementwise ops (the loss-scale update, an fp8 cast) costs a dozen kernel
launches eagerly: on a GPU that is launch overhead, on large tensors it is a dozen passes over memory.
``FusedFunction(fn)`` compiles ``fn`` once with ``dynamic=True`` (one graph for every shape) the first
time it is called; Inductor turns it into one or two kernels. The numbers do not change: the same
function is what runs.

Where torch.compile cannot build it (no C++ compiler or Triton, an old torch) the first call warns
once (``FusionWarning``, naming the function and the error) and every call runs ``fn`` eagerly. Inside
a graph the user compiles, ``fn`` itself is traced (the outer compile fuses it with its neighbours).

    >>> double = FusedFunction(lambda x: x * 2, "double")
    >>> double(torch.ones(2), fused=False)
    tensor([2., 2.])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FusedFunction", "FusionWarning"]


class FusionWarning(UserWarning):
    """torch.compile could not build one of mixprec's fused functions; its eager version runs instead."""


class FusedFunction:
    """``fn`` compiled on first use (``fused=True`` calls), eager where compiling fails or is off."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name = fn, name
        self._compiled: Callable[..., Any] | None = None
        self.broken: str | None = None     # why compiling failed, once it has

    def __call__(self, *args: Any, fused: bool = True) -> Any:
        if not fused or self.broken is not None or torch.compiler.is_compiling():
            return self.fn(*args)
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, dynamic=True)
            return self._compiled(*args)
        except Exception as exc:   # any failure of the compiler stack: eager for good, said once
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            self.broken = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            warnings.warn(f"mixprec could not compile its fused {self.name} here ({self.broken}); the "
                          "eager version runs instead (the same numbers, more kernels)",
                          FusionWarning, stacklevel=2)
            return self.fn(*args)

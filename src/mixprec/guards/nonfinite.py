"""Where the first inf or NaN of a step came from: module, aten op, forward or backward, input ranges.

A loss scaler only learns *that* some gradient is not finite. ``NonfiniteTracer`` watches every aten op
of the forward and the backward (a ``TorchDispatchMode``, so it sees the ops autocast actually runs, in
their real dtypes) and, per op, keeps ``aminmax`` of each floating input (taken before the op runs, so
in-place ops report what they were given) and of each floating output, as device tensors. Nothing is
read back while the step runs: no host sync. Only when asked, ``report()`` stacks the outputs' minima
and maxima (one sync), finds the first op whose output is not finite and names it::

    tracer = NonfiniteTracer(model)
    with tracer:                                  # forward and backward inside
        loss = loss_fn(model(x), y)
        loss.backward()
    origin = tracer.report()                      # None when every value stayed finite
    print(origin)                                 # "backward of 'head' (aten.mm.default) overflowed ..."
    tracer.remove()

``MixedPrecision(..., trace_nonfinite=True)`` does this for each step and keeps the result as
``mp.last_overflow``. Module attribution comes from ``ModuleScope``: an op of the backward belongs to
the module whose forward created the autograd node running it.

Cost when on: one ``aminmax`` per floating input and output of every op that is not a view (a read of
the tensor), Python dispatch per op, and two forward hooks per module call; the per-op records are
dropped at the next step. benchmarks/RESULTS.md has the measured ratio. When off nothing is installed.

This module imports torch and ``formats`` only (never the engine), so any layer may use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..formats import get_format
from .module_scope import ModuleScope

__all__ = ["NonfiniteTracer", "NonfiniteOrigin", "TensorRange", "first_nonfinite"]

# dtypes torch.aminmax reads directly; other floating dtypes (fp8) are upcast to fp32 first, exactly.
_AMINMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class TensorRange:
    """One tensor an op read or wrote: dtype, shape, smallest and largest value, the format's max."""

    dtype: str                 # e.g. "torch.float16"
    shape: tuple[int, ...]
    min: float                 # NaN if the tensor holds a NaN
    max: float
    format_max: float | None   # the largest finite value of the dtype (mixprec.formats); None if unknown

    @property
    def amax(self) -> float:
        """max |x|."""
        return max(abs(self.min), abs(self.max))

    @property
    def finite(self) -> bool:
        return math.isfinite(self.min) and math.isfinite(self.max)

    def __str__(self) -> str:
        short = self.dtype.replace("torch.", "")
        limit = f" (max {self.format_max:.6g})" if self.format_max is not None else ""
        return f"{short}{list(self.shape)} in [{self.min:.6g}, {self.max:.6g}], amax {self.amax:.6g}{limit}"


@dataclasses.dataclass(frozen=True)
class NonfiniteOrigin:
    """The first op of a traced step whose output held an inf or NaN.

    ``cause`` says how: ``"overflow"`` (finite inputs, an infinite output: a value beyond the output
    format's max), ``"nan"`` (finite inputs, a NaN output: inf - inf, 0 * inf, 0/0, log of a negative)
    or ``"inherited"`` (an input was already non-finite when the op got it: data or weights that were
    not finite, or a value produced outside the traced region).
    """

    module: str                       # qualified name, "(model)", "(outside the model)", ...
    op: str                           # aten overload, e.g. "aten.addmm.default"
    direction: str                    # "forward" or "backward"
    node: str | None                  # the autograd node running it in the backward, e.g. "AddmmBackward0"
    cause: str                        # "overflow", "nan" or "inherited"
    inputs: tuple[TensorRange, ...]
    outputs: tuple[TensorRange, ...]
    format: str                       # the output format's name, e.g. "fp16"
    format_max: float | None          # its largest finite value, e.g. 65504.0
    op_index: int                     # position among the traced ops of the step (0-based)
    ops_traced: int                   # traced ops in the step
    loss_scale: float | None = None   # the loss scale the backward ran under, where the engine knows it

    def __str__(self) -> str:
        where = f"{self.direction} of {self.module!r}"
        if self.node:
            where += f" (autograd node {self.node})"
        what = {"overflow": f"overflowed {self.format} (max {self.format_max:g})"
                if self.format_max is not None else "overflowed",
                "nan": "produced NaN from finite inputs",
                "inherited": "received a non-finite input"}[self.cause]
        lines = [f"first non-finite value: {where}, {self.op} {what}; op {self.op_index + 1} of "
                 f"{self.ops_traced} traced"]
        lines += [f"  input {i}: {r}" for i, r in enumerate(self.inputs)]
        lines += [f"  output {i}: {r}" for i, r in enumerate(self.outputs)]
        if self.loss_scale is not None and self.direction == "backward":
            lines.append(f"  loss scale during the backward: {self.loss_scale:g}")
        return "\n".join(lines)


@dataclasses.dataclass
class _Record:
    op: str
    module: str
    direction: str
    node: str | None
    inputs: list[tuple[torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]]
    outputs: list[tuple[torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]]


def _floating(values: object) -> list[torch.Tensor]:
    # aten arguments nest at most one level (Tensor[] arguments such as cat's); a hand-written walk
    # costs a fraction of a general pytree flatten, and this runs for every op.
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() and v.numel() > 0 and v.device.type != "meta":
                out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _floating(v)
    return out


def _ranges(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]]:
    out = []
    for t in tensors:
        # detach: the stats are observations, never part of the autograd graph.
        x = t.detach() if t.dtype in _AMINMAX_DTYPES else t.detach().float()
        lo, hi = torch.aminmax(x)          # one read; NaN propagates into both
        out.append((t.dtype, tuple(t.shape), lo, hi))
    return out


class _Watch(TorchDispatchMode):
    """Records aminmax of every non-view op's floating inputs and outputs, as device tensors."""

    def __init__(self, tracer: NonfiniteTracer, backward: bool) -> None:
        super().__init__()
        self._tracer = tracer
        self._backward = backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = _WATCHED.get(func)
        if watched is None:
            # A view shares its input's values: it cannot create an inf or NaN, so it is not watched.
            watched = _WATCHED[func] = not func.is_view and func not in _UNWATCHED
        if not watched:
            return func(*args, **kwargs)
        # Before the op: in-place ops overwrite their inputs.
        inputs = _ranges(_floating(args) + _floating(kwargs.values()) if kwargs else _floating(args))
        out = func(*args, **kwargs)
        outputs = _floating(out if isinstance(out, (tuple, list)) else (out,))
        if outputs:
            node = torch._C._current_autograd_node()
            scope = self._tracer._scope
            backward = self._backward or node is not None
            module = scope.owner(node) if backward else scope.current()
            self._tracer._records.append(_Record(
                str(func), module, "backward" if backward else "forward",
                node.name() if node is not None else None, inputs, _ranges(outputs)))
        return out


_WATCHED: dict = {}     # OpOverload -> whether to watch it, decided once per op

# Ops that copy or fill without arithmetic on values that could overflow: skipped to save a read.
_UNWATCHED = {torch.ops.aten.detach.default, torch.ops.aten.clone.default,
              torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default,
              torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar,
              torch.ops.aten.empty_like.default, torch.ops.aten.new_empty_strided.default}


class NonfiniteTracer:
    """Watches a model's forward and backward ops for the first inf or NaN; see the module docstring.

    Constructing it installs two forward hooks on every module of ``model``; ``remove()`` takes them
    off. The dispatch mode is active only inside ``with tracer:`` (or ``tracing()``).
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NonfiniteTracer needs a torch.nn.Module, got {type(model).__name__}")
        self._scope = ModuleScope(model)
        self._records: list[_Record] = []
        self._stack = contextlib.ExitStack()

    @contextlib.contextmanager
    def tracing(self, backward: bool = False) -> Iterator[None]:
        """Watch the ops run inside; ``backward=True`` marks them all as backward ops."""
        with _Watch(self, backward):
            yield

    def __enter__(self) -> NonfiniteTracer:
        self._stack.enter_context(self.tracing())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def ops_traced(self) -> int:
        return len(self._records)

    def report(self, loss_scale: float | None = None) -> NonfiniteOrigin | None:
        """The first op whose output was not finite since the last ``reset()``; None if none was.

        Forces one host sync (the outputs' minima and maxima are read in one transfer), and more for
        the offending op's ranges.
        """
        return first_nonfinite(self._records, loss_scale)

    def take(self) -> list[_Record]:
        """Hand over the records so far and start afresh (the engine calls it at every step)."""
        records, self._records = self._records, []
        self._scope.clear()
        return records

    def reset(self) -> None:
        """Drop the records of the ops traced so far."""
        self.take()

    def remove(self) -> None:
        """Take the module hooks off the model and drop the records."""
        self._scope.remove()
        self._records = []


def first_nonfinite(records: list[_Record], loss_scale: float | None = None) -> NonfiniteOrigin | None:
    """The first of ``records`` (from ``NonfiniteTracer.take``) with a non-finite output, or None."""
    if not records:
        return None
    # One flag per op output: finite min and max <=> every value finite (NaN propagates).
    bounds = torch.stack([x.float() for r in records for (_, _, lo, hi) in r.outputs
                          for x in (lo, hi)]).view(-1, 2)          # (outputs, 2): min, max
    bad = (~torch.isfinite(bounds).all(dim=1)).nonzero()
    if len(bad) == 0:
        return None
    first_output = int(bad[0])
    counts = [len(r.outputs) for r in records]
    index = next(i for i, c in enumerate(_cumulative(counts)) if c > first_output)
    record = records[index]
    inputs = tuple(_range(r) for r in record.inputs)
    outputs = tuple(_range(r) for r in record.outputs)
    bad_out = next(o for o in outputs if not o.finite)
    if not all(i.finite for i in inputs):
        cause = "inherited"
    elif math.isnan(bad_out.min) or math.isnan(bad_out.max):
        cause = "nan"
    else:
        cause = "overflow"
    fmt = _format_name(bad_out.dtype)
    return NonfiniteOrigin(
        module=record.module, op=record.op, direction=record.direction, node=record.node,
        cause=cause, inputs=inputs, outputs=outputs, format=fmt, format_max=bad_out.format_max,
        op_index=index, ops_traced=len(records), loss_scale=loss_scale)



def _cumulative(counts: list[int]) -> Iterator[int]:
    total = 0
    for c in counts:
        total += c
        yield total


def _format_name(dtype_name: str) -> str:
    try:
        return get_format(getattr(torch, dtype_name.replace("torch.", ""))).name
    except (ValueError, AttributeError, TypeError):
        return dtype_name.replace("torch.", "")


def _range(entry: tuple[torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]) -> TensorRange:
    dtype, shape, lo, hi = entry
    try:
        fmt_max: float | None = get_format(dtype).max
    except ValueError:
        fmt_max = None    # e.g. float64: not one of mixprec's formats
    return TensorRange(str(dtype), shape, float(lo), float(hi), fmt_max)

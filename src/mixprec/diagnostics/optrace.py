"""What ran in which dtype: every aten op of one forward and backward, grouped by module.

A ``TorchDispatchMode`` sits below autocast and autograd, so it sees each op as it really runs: after
autocast's casts, after the recipe's op-list edits and module regions, and in the backward pass too.
``torch.utils.module_tracker.ModuleTracker`` says which module (forward) or whose gradient (backward)
is being computed. View ops (``view``, ``transpose``, ``split``, ...) and ``detach`` move no numbers
and are left out; casts show up as ``_to_copy``::

    trace = trace_ops(model, "bf16,fp32_ops=layer_norm", lambda m: F.cross_entropy(m(x), y))
    [r.op for r in trace.records if r.output == "bf16" and r.phase == "forward"]   # ['addmm', ...]
    trace.to_json()

The model is deep-copied first, so tracing a pure recipe leaves the caller's weights as they were.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.module_tracker import ModuleTracker

from ..engine import MixedPrecision
from ..recipe import Recipe, get_recipe

__all__ = ["OpRecord", "OpTrace", "trace_ops", "dtype_name"]

_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_SKIPPED = {"detach", "alias", "lift_fresh"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; other dtypes by torch's own name (``int64``)."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op in one module and phase, with its dtypes, and how many times it ran so.

    ``module`` is the qualified name of the innermost module running (``""``: the model itself or
    code outside it, such as the loss); ``inputs`` the dtypes of its floating-point tensor inputs;
    ``output`` the dtype of its first tensor output (``"-"`` for none).
    """

    module: str
    phase: str            # "forward" | "backward"
    op: str               # aten name with overload, e.g. "addmm", "_softmax", "native_layer_norm"
    inputs: tuple[str, ...]
    output: str
    count: int


@dataclasses.dataclass(frozen=True)
class OpTrace:
    """The ops of one forward and backward under ``recipe`` on ``device``, in first-run order."""

    recipe: str
    device: str
    records: tuple[OpRecord, ...]

    def select(self, *, module: str | None = None, phase: str | None = None,
               op: str | None = None) -> list[OpRecord]:
        """The records matching every given field (``op`` matches with or without the overload)."""
        return [r for r in self.records
                if (module is None or r.module == module) and (phase is None or r.phase == phase)
                and (op is None or r.op == op or r.op.split(".")[0] == op)]

    def counts_by_dtype(self, phase: str) -> dict[str, int]:
        """How many op calls produced each output dtype in ``phase``."""
        out: dict[str, int] = {}
        for r in self.records:
            if r.phase == phase:
                out[r.output] = out.get(r.output, 0) + r.count
        return out

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> OpTrace:
        data = json.loads(text)
        records = tuple(OpRecord(**{**r, "inputs": tuple(r["inputs"])}) for r in data["records"])
        return cls(recipe=data["recipe"], device=data["device"], records=records)


class _Recorder(TorchDispatchMode):
    """Counts (module, phase, op, input dtypes, output dtype); forwards every call unchanged."""

    def __init__(self, tracker: ModuleTracker, root: str) -> None:
        super().__init__()
        self.tracker = tracker
        self.root = root
        self.counts: dict[tuple, int] = {}

    def _module(self) -> str:
        # parents holds every module currently running ("Global" always): the deepest is innermost.
        name = max(self.tracker.parents, key=lambda n: (n.count("."), n != "Global"))
        return "" if name in ("Global", self.root) else name.removeprefix(self.root + ".")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._opname in _SKIPPED:
            return out
        inputs = tuple(dtype_name(t.dtype) for t in tree_leaves((args, kwargs or {}))
                       if isinstance(t, torch.Tensor) and t.is_floating_point())
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        output = dtype_name(first.dtype) if first is not None else "-"
        op = func._opname if func._overloadname == "default" else f"{func._opname}.{func._overloadname}"
        key = (self._module(), "backward" if self.tracker.is_bw else "forward", op, inputs, output)
        self.counts[key] = self.counts.get(key, 0) + 1
        return out


def trace_ops(model: nn.Module, recipe: str | Recipe, batch_fn: Callable[[nn.Module], torch.Tensor], *,
              loss_scale: bool = True) -> OpTrace:
    """Run ``batch_fn(model_copy)`` (it returns the loss) under ``recipe``, then backward; the ops seen.

    A deep copy of ``model`` is prepared by ``MixedPrecision`` exactly as training would (weights cast,
    module regions, op-list edits), on the device of its parameters; the forward runs in
    ``mp.autocast()`` and the backward through ``mp.backward`` (the loss scale's multiply included;
    ``loss_scale=False`` calls ``loss.backward()`` instead). No optimizer step is taken. Syncs with the
    host (every op is observed as it runs).
    """
    recipe = get_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(batch_fn):
        raise TypeError("batch_fn must be a callable that takes the model and returns the loss, e.g. "
                        "lambda m: F.cross_entropy(m(x), y)")
    model = copy.deepcopy(model)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
    with ModuleTracker() as tracker:
        recorder = _Recorder(tracker, type(model).__name__)
        with recorder:
            with mp.autocast():
                loss = batch_fn(model)
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"batch_fn must return the loss as a tensor, got {type(loss).__name__}")
            if loss_scale:
                mp.backward(loss)
            else:
                loss.backward()
    records = tuple(OpRecord(m, phase, op, inputs, output, n)
                    for (m, phase, op, inputs, output), n in recorder.counts.items())
    return OpTrace(recipe=str(recipe), device=str(mp.device), records=records)

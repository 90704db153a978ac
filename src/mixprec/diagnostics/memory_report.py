"""Predicted (and, where asked, measured) training memory of one model under one recipe.

``memory_report(model, recipe, batch, optimizer=...)`` answers "where does the memory go?" before any
memory is spent. It runs the real engine, ``MixedPrecision``, on a *fake* copy of the model (torch's
``FakeTensorMode``: tensors with shapes, dtypes and storages of the right size, but no data) for one
forward and backward, and counts with the same tools a real run uses (``state_bytes`` and
``SavedTensorMeter``): weights as the recipe holds them, gradients, fp32 master copies, and the tensors
autograd saves for the backward. Optimizer state appears only when the optimizer steps, which fake
tensors cannot do (optimizers read their step counters back), so it is measured on a miniature: the
optimizer is built on twins of the parameters with one and two elements and stepped once, which gives
its bytes per element and per tensor. A 784-8192-10 MLP (6.5M parameters)::

    >>> from torch import nn
    >>> mlp = nn.Sequential(nn.Linear(784, 8192), nn.ReLU(), nn.Linear(8192, 10))
    >>> r = memory_report(mlp, "fp32", torch.zeros(64, 784))
    >>> round(r.predicted.params / 1e6, 2)
    26.05

``measure=True`` also trains one real step on a deep copy (the model is left alone) and fills
``measured`` the way ``mixprec compare`` does (and, on CUDA, the allocator's peak). Activations are
predicted with the autocast op lists of the CPU (fake tensors live there): on CUDA a few ops differ.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..casting.model import low_precision_params
from ..update.compact_adamw import moment_bytes
from ..engine import MixedPrecision
from ..update.transients import kept_gradient_bytes
from ..model_io import call_model, output_loss
from ..recipe import Precision, Recipe, get_recipe
from ..recipe.moments import Moments
from .memory import MemoryBreakdown, SavedTensorMeter, saved_by, state_bytes, storage_bytes
from .memory_peak import fake_step_peak, step_transients
from .shadow import meta_like, shadow_copy

__all__ = ["MemoryReport", "memory_report", "predict_optimizer_bytes", "predict_moment_bytes"]

OptimizerSpec = Union[torch.optim.Optimizer, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], None]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes by role for one recipe: predicted always, measured when a real step was run."""

    recipe: str                          # the full recipe string
    label: str                           # its name where it has one
    n_params: int                        # trainable parameter elements
    predicted: MemoryBreakdown
    measured: MemoryBreakdown | None = None
    # Saved activations split by (op that made them, dtype): ((op, dtype, bytes), ...), largest first.
    saved: tuple[tuple[str, str, int], ...] = ()
    saved_measured: tuple[tuple[str, str, int], ...] | None = None

    @property
    def saved_by_dtype(self) -> dict[str, int]:
        """Predicted saved-activation bytes by dtype name: what a 16-bit recipe still saves in fp32."""
        out: dict[str, int] = {}
        for _, dtype, nbytes in self.saved:
            out[dtype] = out.get(dtype, 0) + nbytes
        return out

    @property
    def bytes_per_param(self) -> float:
        """(weights + gradients + master + optimizer state) / parameters: 16 for fp32 Adam."""
        b = self.predicted
        return (b.params + b.grads + b.master + b.optimizer) / self.n_params


def memory_report(model: nn.Module, recipe: str | Recipe, batch: Any, *, optimizer: OptimizerSpec = None,
                  loss_fn: Callable[..., torch.Tensor] | None = None, measure: bool = False) -> MemoryReport:
    """Predict the memory of one training step of ``model`` under ``recipe``; see the module docstring.

    ``batch`` is the model's input (a tensor, a tuple of positional inputs, or a dict of keyword
    inputs such as ``input_ids=..., labels=...``), or ``(inputs, targets)`` when ``loss_fn(outputs,
    targets)`` is given. Without ``loss_fn`` the backward starts from the output's own ``loss`` (HF
    models given labels), else from the sum of the floating outputs. ``optimizer`` is an optimizer
    built on ``model``'s parameters, a factory ``params -> optimizer`` (as workloads have), or None
    (no optimizer state). ``model`` may be on the meta device (nothing allocated) unless ``measure``.
    No host sync for the prediction.
    """
    recipe = get_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: there is no training "
                         "memory to report")
    # TF32 changes how matmuls round, not what is stored: predict it as fp32 (which runs on any device).
    traced = dataclasses.replace(recipe, compute=Precision.FP32) if recipe.compute is Precision.TF32 else recipe
    # The moments' format changes the optimizer's state only (predicted below), not what the step traces.
    traced = dataclasses.replace(traced, moments=Moments.FP32)
    _check_batch(model, batch, loss_fn)
    try:
        predicted, saved, inputs = _predict(model, traced, batch, loss_fn)   # inputs: (batch bytes, grads at step())
    except TypeError as e:
        if loss_fn is None and isinstance(batch, (tuple, list)) and len(batch) == 2 and "positional" in str(e):
            # (x, y) without loss_fn is read as two positional inputs: the likely slip is a missing loss_fn.
            raise ValueError(f"memory_report passed batch's 2 items to {type(model).__name__}.forward as "
                             f"positional inputs, and it refused them ({e}); if batch is (inputs, targets), "
                             "give the loss: memory_report(model, recipe, (x, y), loss_fn=F.cross_entropy)") from None
        raise
    if recipe.moments is Moments.FP32:
        optimizer_bytes = predict_optimizer_bytes(optimizer, model)
    else:   # the engine's own AdamW holds the moments: its format says their size
        optimizer_bytes = predict_moment_bytes(recipe.moments, optimizer, model)
    predicted = dataclasses.replace(predicted, optimizer=optimizer_bytes)
    predicted = dataclasses.replace(predicted, peak=_peak(predicted, inputs, traced, optimizer, model))
    measured, saved_measured = _measure(model, recipe, batch, optimizer, loss_fn) if measure else (None, None)
    return MemoryReport(str(recipe), recipe.label, sum(p.numel() for p in params), predicted, measured,
                        saved, saved_measured)


def _check_batch(model: nn.Module, batch: Any, loss_fn) -> None:
    """TypeError/ValueError for a ``loss_fn`` that is not a function, a batch without a tensor, and
    integer inputs to a model with no embedding to take them: its first matmul would refuse them (and
    the fake trace would not notice)."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(outputs, targets) -> tensor (e.g. "
                        f"F.cross_entropy) or None, got {type(loss_fn).__name__} {loss_fn!r}")
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(dict(batch) if isinstance(batch, Mapping)
                                                                 else batch)):
        raise ValueError(f"batch holds no tensor (got {type(batch).__name__}): pass the model's input (a "
                         "tensor, a tuple of them or a dict of keyword inputs), or (inputs, targets) with loss_fn=")
    if any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules()):
        return
    inputs = batch[0] if loss_fn is not None and isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
    leaves = [t for t in tree_leaves(dict(inputs) if isinstance(inputs, Mapping) else inputs)
              if isinstance(t, torch.Tensor)]
    ints = [t for t in leaves if not t.is_floating_point() and not t.is_complex()]
    if ints and len(ints) == len(leaves):
        raise ValueError(f"the batch's inputs are {str(ints[0].dtype).removeprefix('torch.')} and "
                         f"{type(model).__name__} has no nn.Embedding to take integer ids: pass floating-point "
                         "inputs (e.g. x.float())" + ("" if loss_fn is not None else
                                                    ", and (inputs, targets) with loss_fn="))


def _split(batch: Any, loss_fn) -> tuple[Any, Any]:
    # A mapping batch (an HF BatchEncoding is a UserDict) becomes a plain dict, which tree_map walks.
    plain = (lambda x: dict(x) if isinstance(x, Mapping) else x)
    if loss_fn is None:
        return plain(batch), None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("with loss_fn, batch must be (inputs, targets); without it, the model's input")
    return plain(batch[0]), batch[1]


def _loss(out: Any, targets: Any, loss_fn) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(out, targets)
    own = output_loss(out)            # an HF model given labels computes its loss itself
    if own is not None:
        return own
    floats = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise ValueError("the model's output holds no floating tensor to take a gradient of; pass loss_fn")
    return sum(t.float().sum() for t in floats)


def _one_step(mp: MixedPrecision, model: nn.Module, inputs: Any, targets: Any, loss_fn
              ) -> tuple[int, tuple[tuple[str, str, int], ...]]:
    """Forward and backward under ``mp``; returns the activation bytes autograd saved, and their split."""
    with SavedTensorMeter(model, mp.master.masters if mp.master else []) as meter:
        with mp.autocast():
            loss = _loss(call_model(model, inputs), targets, loss_fn)
        mp.backward(loss)
    return meter.bytes, saved_by(meter.groups)


def _predict(model: nn.Module, recipe: Recipe, batch: Any, loss_fn
             ) -> tuple[MemoryBreakdown, tuple[tuple[str, str, int], ...], tuple[int, int]]:
    """State and saved activations of one fake step, with ``peak`` the forward/backward's peak without
    optimizer state; the saved activations split by (dtype, op); and ``(bytes of the batch, bytes of
    the model's gradients when step() starts)``."""
    inputs, targets = _split(batch, loss_fn)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False), _RealStatDtypes(), _quiet_fake_tensor_log():
            shadow = shadow_copy(model, "cpu")
            fake_in, fake_targets = meta_like((inputs, targets), "cpu")   # one memo: aliases stay
            # A stand-in optimizer (plain SGD makes no state): the engine needs one to wire masters.
            mp = MixedPrecision(shadow, torch.optim.SGD(shadow.parameters(), lr=0.0), recipe)
            batch_bytes = storage_bytes(t for t in tree_leaves((fake_in, fake_targets))
                                        if isinstance(t, torch.Tensor))
            before = state_bytes(mp).total + batch_bytes        # alive before the step: weights, masters, batch
            (activations, saved), peak = fake_step_peak(
                lambda: _one_step(mp, shadow, fake_in, fake_targets, loss_fn), before)
            grads_at_step = state_bytes(mp).grads     # the model's gradients, as step() finds them
            # No fp32 gradient outlives step(): the copies' gradients are transients of one chunk
            # (step_transients measures them inside the step).
            return (dataclasses.replace(state_bytes(mp), optimizer=0, activations=activations, peak=peak),
                    saved, (batch_bytes, grads_at_step))
    except (RuntimeError, NotImplementedError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot predict the memory of {type(model).__name__}: tracing it with fake "
                         f"tensors (shapes only) failed: {first}. Its ops need meta kernels and its "
                         "control flow must not read tensor values") from None


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Hold back the traceback torch logs (at ERROR, to stderr) when an op fails on fake tensors: the
    failure is raised as the ValueError above, which names it; the log printed a traceback before it."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    saved = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(saved)


def _peak(predicted: MemoryBreakdown, inputs: tuple[int, int], recipe: Recipe, optimizer: OptimizerSpec,
          model: nn.Module) -> int:
    """The step's peak (memory_peak.py): the forward/backward's, or step()'s on top of the state after
    the backward; the optimizer state is alive at both moments."""
    batch_bytes, grads_at_step = inputs
    # A small model's fp32 transients (pure, bf16-sr, bf16-kahan) outlive the step: alive in the backward.
    low = sum(p.numel() for p in low_precision_params(model, recipe))
    kept = kept_gradient_bytes(low, recipe.master is not None) if low else 0
    forward_backward = predicted.peak + predicted.optimizer + kept
    state = predicted.params + grads_at_step + predicted.master + predicted.optimizer + batch_bytes
    params = list(model.parameters())
    build = ((lambda twins: _rebuild(optimizer, params, twins)) if optimizer is not None
             else (lambda twins: torch.optim.SGD(twins, lr=0.0)))
    transients = step_transients(recipe, build, params, device_type=params[0].device.type)
    return max(forward_backward, state + transients)


class _RealStatDtypes(TorchDispatchMode):
    """Fake tensors run meta kernels, and the meta kernels of layer, group and batch norm give the
    mean and rstd they save the input's dtype; the CPU and CUDA kernels keep them in fp32 for fp16/bf16
    inputs (their accumulation type). Upcast them, so the prediction saves what a real step saves."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if "norm" in name and "backward" not in name and isinstance(out, tuple) and len(out) >= 3:
            # (output, mean, rstd[, reserve]) for layer, group and batch norm alike.
            out = (out[0], *(_as_fp32_stat(t) for t in out[1:3]), *out[3:])
        return out


def _as_fp32_stat(t: torch.Tensor) -> torch.Tensor:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t


def predict_optimizer_bytes(optimizer: OptimizerSpec, model: nn.Module) -> int:
    """Bytes of optimizer state after the first step, from a miniature of the optimizer.

    Optimizer state grows as ``a * numel + b`` per parameter (Adam: a = 8, two fp32 moments; b = 4, an
    fp32 step counter). Each parameter gets twins of one and of two elements, same number of
    dimensions and group options; one real step on each set gives a and b. The optimizer always holds
    fp32 tensors under mixprec (fp32 weights or fp32 copies), so the twins are fp32.
    """
    if optimizer is None:
        return 0
    params = list(model.parameters())
    sizes = []
    for elements in (1, 2):
        twins = [torch.zeros((elements,) + (1,) * max(p.dim() - 1, 0), requires_grad=p.requires_grad)
                 for p in params]
        probe = _rebuild(optimizer, params, twins)
        for t in twins:
            t.grad = torch.zeros_like(t)
        probe.step()
        sizes.append([_state_bytes(probe.state.get(t, {})) for t in twins])
    total = 0
    for p, one, two in zip(params, *sizes):
        per_element = two - one
        total += per_element * p.numel() + (one - per_element)
    return total


def predict_moment_bytes(fmt: Moments, optimizer: OptimizerSpec, model: nn.Module) -> int:
    """Bytes of compact Adam moments (``moments=`` in the recipe): two per trainable tensor, in ``fmt``
    (bf16: 2 + 2 B per element; fp8: 1 + 1 B plus an fp32 scale per 128). The step counts are
    Python ints: no tensor."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, torch.optim.Optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    return sum(2 * moment_bytes(fmt, p.numel()) for p in params)


def _state_bytes(state: dict) -> int:
    return sum(v.untyped_storage().nbytes() for v in state.values() if isinstance(v, torch.Tensor))


def _rebuild(optimizer: OptimizerSpec, params: list[nn.Parameter], twins: list[torch.Tensor]):
    """The user's optimizer, rebuilt over ``twins`` (same groups and options)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        index = {id(p): i for i, p in enumerate(params)}
        groups = []
        for group in optimizer.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            members = [twins[index[id(p)]] for p in group["params"] if id(p) in index]
            if len(members) != len(group["params"]):
                raise ValueError("the optimizer holds parameters that are not the model's: build it from "
                                 "model.parameters()")
            groups.append({"params": members, **options})
        return type(optimizer)(groups)
    if callable(optimizer):
        probe = optimizer(twins)
        if not isinstance(probe, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory returned {type(probe).__name__}, not a torch.optim.Optimizer")
        return probe
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, a function params -> optimizer, or None; "
                    f"got {type(optimizer).__name__}")


def _measure(model: nn.Module, recipe: Recipe, batch: Any, optimizer: OptimizerSpec, loss_fn):
    """One real step on a deep copy of ``model``, counted as ``mixprec compare`` counts its first step."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("measure=True needs a model with real weights; this one is on the meta device")
    twin = copy.deepcopy(model)
    params = list(model.parameters())
    if optimizer is None:
        opt = torch.optim.SGD(twin.parameters(), lr=0.0)
        recipe = dataclasses.replace(recipe, moments=Moments.FP32)    # no optimizer: no moments either
    else:
        opt = _rebuild(optimizer, params, list(twin.parameters()))
    device = params[0].device
    inputs, targets = _split(batch, loss_fn)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mp = MixedPrecision(twin, opt, recipe)
    activations, saved = _one_step(mp, twin, inputs, targets, loss_fn)
    mp.step()
    measured = dataclasses.replace(state_bytes(mp), activations=activations)
    if device.type == "cuda":
        measured = dataclasses.replace(measured, peak=torch.cuda.max_memory_allocated(device))
    return measured, saved

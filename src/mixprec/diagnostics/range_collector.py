"""Per-module numeric ranges of a training run: activations, their gradients, weights, weight gradients, updates.

A :class:`RangeCollector` watches a :class:`~mixprec.MixedPrecision` engine while its ``collecting()``
block is open and, per module (by qualified name), feeds five kinds of tensors to exact
:class:`~mixprec.diagnostics.range_histogram.RangeHistogram` counters on the device:

- ``activations``: the module's forward outputs (as computed: fp16 under fp16 autocast);
- ``activation_grads``: gradients with respect to those outputs (tensor hooks on them);
- ``weights``: the weights the optimizer updates (fp32 master copies where the recipe keeps them);
- ``weight_grads``: the gradients of the module's own parameters, as backward left them;
- ``updates``: what the optimizer step changed each weight by (fp32), skipped steps left out.

Gradients are counted in true units: loss-scaled gradients are multiplied by ``1/S`` first (exact for
the power-of-two scales the dynamic scaler uses). It also counts, exactly, the updates that would
vanish if added to fp16 or bf16 weights (:func:`update_lost`), the reason master weights exist::

    collector = RangeCollector(mp)
    for step, (x, y) in enumerate(batches):
        with collector.collecting(enabled=step < 5):   # off: no hook is installed at all
            with mp.autocast():
                loss = loss_fn(model(x), y)
            mp.backward(loss)
            mp.step()
        mp.zero_grad()
    ranges = collector.result()       # one host sync; RangesResult, per module
    ranges.module("0").stats["weight_grads"].fraction("fp16", "flush")

Cost while collecting: one compiled counting kernel and a ``bincount`` per large activation and
activation gradient (:mod:`.range_bins`), one copy per small one (:mod:`.range_batch`, counted
together at the end of the block), a fixed number for all weights, weight gradients and updates
together (one :meth:`RangeHistogram.add_segments` each), no host sync; memory: one fp32 copy of the
weights and one of the gradients per step, an 8 MiB buffer for the small tensors, and scratch
buffers of 12 bytes per value of the largest piece (2**19 values) counted. Off, nothing is
installed; ``RangeCollector(mp, every=k)`` counts only every k-th step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..loss_scale.scales import NoLossScale
from .range_batch import SmallTensorBatch
from .range_histogram import RangeHistogram, TensorStats
from .update_loss import UPDATE_FORMATS, UpdateLoss, lost_masks, update_lost

__all__ = ["KINDS", "UPDATE_FORMATS", "ModuleRanges", "RangeCollector", "RangesResult", "UpdateLoss",
           "select_modules", "update_lost"]

KINDS = ("activations", "activation_grads", "weights", "weight_grads", "updates")
_LOST_GROUP = 1 << 19    # values per pass of the lost-update count in the collector


@dataclasses.dataclass(frozen=True)
class ModuleRanges:
    """One module's statistics: ``stats[kind]`` for each of :data:`KINDS` it produced."""

    name: str
    type: str
    stats: dict[str, TensorStats]
    update_loss: UpdateLoss | None = None

    def gradients(self) -> TensorStats | None:
        """Activation and weight gradients together: what a backward pass in fp16 must hold."""
        return TensorStats.merge([self.stats[k] for k in ("activation_grads", "weight_grads")
                                  if k in self.stats])


@dataclasses.dataclass(frozen=True)
class RangesResult:
    """Everything a collector counted: per module, in model order, and the steps it covered."""

    modules: tuple[ModuleRanges, ...]
    steps: int

    def module(self, name: str) -> ModuleRanges:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(_unknown_module(name, [m.name for m in self.modules]))

    def gradients(self) -> TensorStats | None:
        """Every module's gradients merged: the run's whole gradient distribution."""
        return TensorStats.merge([g for g in (m.gradients() for m in self.modules) if g is not None])


def _unknown_module(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f"no module named {name!r} in the model; {hint}its modules: {shown}"


def select_modules(model: nn.Module, names: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """The modules whose ranges are worth reporting, by qualified name, in model order.

    By default the layers: every module without submodules, and every module that owns parameters
    directly (the model itself included, for a bare ``nn.Linear``). Composite modules (a transformer
    block, its attention) are left out: their output is usually a child's, counted already. ``names``
    keeps only those modules and the layers inside them (a named composite module is then reported
    too); an unknown name is a ValueError that suggests close matches.
    """
    def is_layer(m: nn.Module) -> bool:
        return not any(True for _ in m.children()) or any(True for _ in m.parameters(recurse=False))

    named = dict(model.named_modules())
    if names is None:
        return {n: m for n, m in named.items() if is_layer(m) and (n or m is model)}
    if isinstance(names, str):      # iterated, "blocks.0" would be the names "b", "l", "o", ...
        raise TypeError(f"modules takes a list of module names, e.g. [{names!r}], not a string")
    all_names = [n for n in named if n]
    for name in names:
        if name not in named or not name:
            raise ValueError(_unknown_module(name, all_names) + "; pass names as printed by "
                             "model.named_modules()")
    return {n: m for n, m in named.items()
            if any(n == sel for sel in names)
            or (is_layer(m) and any(n.startswith(sel + ".") for sel in names))}


class RangeCollector:
    """Counts per-module ranges of ``engine``'s training steps while ``collecting()`` is open.

    ``modules`` restricts it to the named modules (and what they contain); see :func:`select_modules`.
    Each parameter belongs to the first selected module that owns it (a tied weight is counted once).
    ``every=k`` samples: of the blocks opened with ``collecting()``, the 1st, (k+1)th, ... are counted
    and the others run as with ``enabled=False`` (nothing installed), dividing the average cost by
    about k; ``steps`` in the result counts the sampled steps only. ``fused`` picks how values are counted (the
    same numbers either way; see :mod:`.range_bins`). ``None`` (the default): one pass per value by a
    compiled counter, Triton on a GPU and C on a CPU (:mod:`.range_native`, built in under a second);
    the lost-update test is compiled on a GPU only, because on a CPU its Inductor build takes 7-18 s,
    longer than the doctor's 20 steps. ``True`` compiles that too; ``False`` runs eager torch ops only.
    """

    def __init__(self, engine: Any, modules: Sequence[str] | None = None, every: int = 1,
                 fused: bool | None = None) -> None:
        if not all(hasattr(engine, a) for a in ("add_step_observer", "model", "optimizer", "device")):
            given = f"the model itself ({type(engine).__name__})" if isinstance(engine, nn.Module) else \
                f"a {type(engine).__name__}"
            raise TypeError(f"RangeCollector watches a MixedPrecision engine, got {given}: build "
                            "mp = MixedPrecision(model, optimizer, recipe) and pass RangeCollector(mp)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (count every k-th step; 1 counts all), "
                             f"got {every!r}")
        self.every = every
        self.fused = True if fused is None else fused       # how the histograms count
        self.fused_lost = engine.device.type == "cuda" if fused is None else fused
        self._opened = 0     # blocks opened with enabled=True, sampled or not
        self.engine = engine
        model: nn.Module = engine.model
        self._modules = select_modules(model, modules)
        if not self._modules:
            raise ValueError(f"{type(model).__name__} has no submodules to watch: give it layers")
        # The tensor the optimizer updates for each model parameter: the fp32 copy, or the parameter.
        master = engine.master
        optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        to_opt = {id(p): m for p, m in zip(master.model_params, master.masters)} if master else {}
        seen: set[int] = set()
        self._params: dict[str, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for name, module in self._modules.items():
            own = []
            for p in module.parameters(recurse=False):
                opt = to_opt.get(id(p), p)
                if id(p) in seen or id(opt) not in optimized:
                    continue
                seen.add(id(p))
                own.append((p, opt))
            if own:
                self._params[name] = own
        self._hist: dict[tuple[str, str], RangeHistogram] = {}
        self._batch = SmallTensorBatch(engine.device)   # small activations and gradients, counted together
        self._lost: dict[str, torch.Tensor] = {}   # per module: lost updates per format
        self._before: torch.Tensor | None = None
        self._collecting = False
        self.steps = 0

    # ----------------------------------------------------------------------------- collecting
    @contextlib.contextmanager
    def collecting(self, enabled: bool = True) -> Iterator[None]:
        """Install the hooks for the block (one training step: forward, backward, ``step()``).

        ``enabled=False`` installs nothing: the block runs exactly as without the collector; so does
        a block that ``every`` leaves out.
        """
        if enabled:
            self._opened += 1
        if not enabled or (self._opened - 1) % self.every:
            yield
            return
        if self._collecting:
            raise RuntimeError("collecting() is already open; close it before opening it again")
        handles = [m.register_forward_hook(self._forward_hook(name)) for name, m in self._modules.items()]
        handles.append(self.engine.add_step_observer(self))
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False
            for h in handles:
                h.remove()
            self._batch.flush()
        self.steps += 1

    def _histogram(self, name: str, kind: str) -> RangeHistogram:
        key = (name, kind)
        if key not in self._hist:
            self._hist[key] = RangeHistogram(self.engine.device, fused=self.fused)
        return self._hist[key]

    def _inverse_scale(self) -> torch.Tensor | None:
        """``1 / S`` as a () device tensor, or None without a loss scale (nothing to undo). No sync."""
        if isinstance(self.engine.loss_scale, NoLossScale):
            return None
        return self.engine.loss_scale.value.reciprocal()   # S a power of two: 1/S is exact

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            for t in _floating_tensors(output):
                self._batch.add(self._histogram(name, "activations"), t)
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: self._grad_hook(name, g))
        return hook

    def _grad_hook(self, name: str, grad: torch.Tensor) -> None:
        self._batch.add(self._histogram(name, "activation_grads"), grad, self._inverse_scale())

    # --------------------------------------------------------- engine step observer protocol
    def before_step(self, engine: Any) -> None:
        """Count weights and weight gradients; remember the weights to measure the update. No sync.

        All modules at once: the weights are concatenated into one fp32 copy (the copy the update is
        measured against) and counted with one :meth:`RangeHistogram.add_segments`; the gradients too.
        """
        names = list(self._params)
        weights = [opt.detach().reshape(-1) for n in names for _, opt in self._params[n]]
        self._before = torch.cat(weights).float()    # a new tensor: cat copies (fp16 weights: converted)
        sizes = [sum(opt.numel() for _, opt in self._params[n]) for n in names]
        RangeHistogram.add_segments([self._histogram(n, "weights") for n in names], self._before, sizes)
        grads, grad_sizes, grad_names = [], [], []
        for n in names:
            own = [p.grad.detach().reshape(-1) for p, _ in self._params[n] if p.grad is not None]
            if own:
                grads += own
                grad_sizes.append(sum(g.numel() for g in own))
                grad_names.append(n)
        if grads:
            RangeHistogram.add_segments([self._histogram(n, "weight_grads") for n in grad_names],
                                        torch.cat(grads), grad_sizes, self._inverse_scale())

    @torch.no_grad()
    def after_step(self, engine: Any, found_inf: torch.Tensor) -> None:
        """Count the updates and those that fp16/bf16 weights would lose; skipped steps count 0. No sync."""
        keep = ~found_inf
        names = list(self._params)
        sizes = [sum(opt.numel() for _, opt in self._params[n]) for n in names]
        w_before = self._before
        update = torch.cat([opt.detach().reshape(-1) for n in names for _, opt in self._params[n]]).float()
        update -= w_before                              # the step's change, in fp32
        RangeHistogram.add_segments([self._histogram(n, "updates") for n in names], update, sizes, keep=keep)
        # Lost updates over groups of whole modules of at least 2**19 values (bounded temporaries,
        # few kernels for small layers), counted per module and format.
        lost, start, group = [], 0, []
        for i, size in enumerate(sizes):
            group.append(size)
            if sum(group) < _LOST_GROUP and i + 1 < len(sizes):
                continue
            stop = start + sum(group)
            # On a CPU Inductor's C++ for these 16-bit patterns is a scalar loop: about as fast as the
            # eager passes at 110k weights (~1 ms), faster below, where eager is ~40 ops of overhead.
            masks = [m.split(group) for m in lost_masks(w_before[start:stop], update[start:stop], self.fused_lost)]
            lost += [torch.count_nonzero(m[j]) for j in range(len(group)) for m in masks]
            start, group = stop, []
        step_counts = torch.stack(lost).view(len(names), len(UPDATE_FORMATS)) * keep.to(torch.int64)
        for n, counts in zip(names, step_counts):
            self._lost[n] = self._lost[n] + counts if n in self._lost else counts
        self._before = None

    # ------------------------------------------------------------------------------ result
    def result(self) -> RangesResult:
        """What was counted, per module in model order. One host sync per counter (at the end only)."""
        self._batch.flush()      # a gradient hook that fired after its block closed waits there
        modules = []
        for name, module in self._modules.items():
            stats = {kind: self._hist[(name, kind)].result() for kind in KINDS if (name, kind) in self._hist}
            loss = None
            if name in self._lost:   # update count and zeros: the "updates" counter has them exactly
                lost = self._lost[name].tolist()
                loss = UpdateLoss(stats["updates"].count, stats["updates"].zeros,
                                  {f.name: n for f, n in zip(UPDATE_FORMATS, lost)})
            if stats:
                modules.append(ModuleRanges(name, type(module).__name__, stats, loss))
        return RangesResult(tuple(modules), self.steps)


def _floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Floating tensors in a module output: a tensor, or nested tuples, lists and dicts of them."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _floating_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floating_tensors(v)

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
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..formats import BF16, FP16, Format, get_format, quantize
from ..fusion import FusedFunction
from ..loss_scale import NoLossScale
from .range_batch import SmallTensorBatch
from .range_histogram import RangeHistogram, TensorStats

__all__ = ["KINDS", "UPDATE_FORMATS", "ModuleRanges", "RangeCollector", "RangesResult", "UpdateLoss",
           "select_modules", "update_lost"]

KINDS = ("activations", "activation_grads", "weights", "weight_grads", "updates")
UPDATE_FORMATS: tuple[Format, ...] = (FP16, BF16)
_LOST_GROUP = 1 << 19    # values per pass of the lost-update count in the collector


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_MAX_CODES: dict[tuple[str, torch.dtype], int] = {}


def _max_code(fmt: Format, stored: torch.dtype, int_dtype: torch.dtype) -> int:
    """``fmt.max``'s bit pattern in its storage dtype, as a Python int (kept: traced code reads it as
    a constant, where computing it would read a tensor back)."""
    key = (fmt.name, stored)
    if key not in _MAX_CODES:
        _MAX_CODES[key] = int(torch.tensor(fmt.max).to(stored).view(int_dtype))
    return _MAX_CODES[key]


def _lost_fp16_bf16(w32: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`update_lost` for each of :data:`UPDATE_FORMATS`, from the same fp32 weights and updates."""
    bits = _update_bits(u)
    return tuple(_lost(w32, *bits, f) for f in UPDATE_FORMATS)


# One compiled kernel for both formats' masks (about forty eager kernels otherwise).
_fused_lost = FusedFunction(_lost_fp16_bf16, "lost-update count")


def _lost_masks(w32: torch.Tensor, u: torch.Tensor, fused: bool = True) -> tuple[torch.Tensor, ...]:
    """:func:`_lost_fp16_bf16`, compiled unless ``fused=False``; the constants it reads are made first."""
    for f in UPDATE_FORMATS:
        _max_code(f, f.torch_dtype, _INT_VIEW[f.torch_dtype.itemsize])
    return _fused_lost(w32, u, fused=fused)


def update_lost(w: torch.Tensor, u: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Where adding the nonzero update ``u`` to ``w`` held in ``fmt`` rounds back to the same weight.

    ``w`` is first rounded to ``fmt`` (as a low-precision model holds it): ``w_q``. Round to nearest
    even puts ``w_q + u`` back on ``w_q`` exactly when ``|u|`` is below half the gap to ``w_q``'s
    neighbour in ``u``'s direction, or equal to it with ``w_q``'s significand even. The neighbour is
    found on ``w_q``'s bit pattern in ``fmt``'s own storage (magnitude plus or minus one step), so the
    denser binade below a power of two, the subnormals and zero need no special cases; the gap is an
    exact fp32 difference of two neighbours (a power of two), halved exactly. Past ``fmt.max`` the
    neighbour is inf (NaN for e4m3fn): there the gap is the one below max, as rounding has it (max is
    never a power of two). No fp32 sum ``w_q + u`` is ever rounded twice. Zero, inf and NaN updates
    are never "lost"; nor is anything on a non-finite ``w_q``. No host sync.

        >>> w = torch.ones(4)
        >>> update_lost(w, torch.tensor([2**-12, 2**-11, 3 * 2**-12, -2**-12]), "fp16")
        tensor([ True,  True, False,  True])
    """
    return _lost(w.detach().to(torch.float32), *_update_bits(u), get_format(fmt))


def _update_bits(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``u``'s fp32 bit pattern, and ``|u|``'s minus 1 with the sign bit cleared (0 goes to the top).

    Nonnegative floats order like their int32 patterns: :func:`_lost` compares ``|u|`` there, and the
    shift sends ``|u| == 0`` above everything, so one compare also leaves zero updates out.
    """
    u32 = u.detach().to(torch.float32)
    return u32.view(torch.int32), u32.abs().view(torch.int32).sub_(1).bitwise_and_(0x7FFFFFFF)


def _lost(w32: torch.Tensor, u_bits: torch.Tensor, size_bits: torch.Tensor, fmt: Format) -> torch.Tensor:
    """:func:`update_lost` on fp32 weights and the two patterns of :func:`_update_bits` (shared by
    the formats, so the collector computes them once per update)."""
    if fmt in (FP16, BF16):
        # The hardware cast rounds to nearest even with subnormals and overflow to inf, as quantize
        # does (tests/test_ranges.py checks update_lost against a quantize-based derivation).
        stored, step = w32.to(fmt.torch_dtype), 1
    elif fmt.torch_dtype is not None and fmt.torch_dtype.itemsize * 8 == fmt.bits:
        # fp8: torch's e4m3fn cast saturates instead of giving NaN, so round with quantize; the cast
        # of a value fmt holds exactly (or of NaN/inf) is then exact.
        stored, step = quantize(w32, fmt).to(fmt.torch_dtype), 1
    else:
        # tf32: an fp32 container whose exponent range is fp32's, so fmt's neighbours, subnormals
        # included, are 2**(23 - mantissa_bits) fp32 bit patterns apart.
        stored, step = quantize(w32, fmt), 1 << (23 - fmt.mantissa_bits)
    nbits = 8 * stored.element_size()
    int_dtype = _INT_VIEW[stored.element_size()]
    code = stored.view(int_dtype)
    magnitude = code & ((1 << (nbits - 1)) - 1)                  # clear the sign bit
    # Everything below is integer and in-place fp32 arithmetic: on the CPU, bool-valued float
    # compares and fresh temporaries cost several times an integer pass.
    u_sign = u_bits if nbits == 32 else (u_bits >> (32 - nbits)).to(int_dtype)   # keeps u's sign bit
    # -1 where u points toward zero from a nonzero w_q (signs differ), else 0: arithmetic shifts.
    toward = ((u_sign ^ code) >> (nbits - 1)) & ((-magnitude) >> (nbits - 1))
    neighbour = magnitude + step + toward * (2 * step)          # magnitude +- one step
    w_abs = magnitude.view(stored.dtype).float()
    half_gap = neighbour.view(stored.dtype).float().sub_(w_abs).abs_()   # exact: adjacent values
    top_gap = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)   # the gap just below max
    half_gap.nan_to_num_(nan=top_gap, posinf=top_gap).mul_(0.5)   # a power of two: halving is exact
    # No update is lost on a non-finite w_q: the smallest non-finite code is one step above max's.
    first_nonfinite = _max_code(fmt, stored.dtype, int_dtype) + step
    half_gap.masked_fill_(magnitude >= first_nonfinite, 0.0)
    # With odd = w_q's last significand bit, "lost" is 0 < |u| < half_gap, or |u| == half_gap with
    # w_q even: 0 < |u|_bits < half_bits + 1 - odd, i.e. size_bits (= |u|_bits - 1, zero at the top)
    # < half_bits - odd: one compare. NaN and inf |u| are above every finite half_gap: never lost.
    odd = (magnitude >> (step.bit_length() - 1)) & 1
    return size_bits < half_gap.view(torch.int32).sub_(odd.to(torch.int32))   # same dtypes: a fast loop


@dataclasses.dataclass(frozen=True)
class UpdateLoss:
    """Weight updates of one module counted over the collected steps (skipped steps left out).

    ``lost[fmt]`` counts the nonzero updates that would round away on weights held in ``fmt``.
    """

    updates: int
    zeros: int
    lost: dict[str, int]

    def fraction(self, fmt: str) -> float:
        """Lost updates as a fraction of the nonzero ones (0.0 when there are none)."""
        live = self.updates - self.zeros
        return self.lost[fmt] / live if live else 0.0


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
    same numbers either way; see :mod:`.range_bins`): ``True`` compiles the counting into one kernel per
    piece, ``False`` runs eager torch ops. ``None`` (the default) compiles on a GPU only: on a CPU the
    compiled route saves about a fifth of the collection's cost per step (gpt) but its first step
    compiles for 7-18 s, longer than the doctor's 20 steps take; on a GPU it turns ~10 kernels per
    piece into one.
    """

    def __init__(self, engine: Any, modules: Sequence[str] | None = None, every: int = 1,
                 fused: bool | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (count every k-th step; 1 counts all), "
                             f"got {every!r}")
        self.every = every
        self.fused = engine.device.type == "cuda" if fused is None else fused
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
            masks = [m.split(group) for m in _lost_masks(w_before[start:stop], update[start:stop], self.fused)]
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

"""The peak of a training step: what is alive at the worst moment, not only what autograd saves.

``memory_report`` counts the state (weights, gradients, master copies, optimizer state) and the
activations autograd saves. The allocator's peak is higher: at its worst moment the step also holds
transients that are never saved, such as the logits and their gradient, the fp32 copy of the logits
that cross-entropy reads, a matmul's output cast, and the optimizer's temporaries (a foreach Adam
makes one fp32 ``sqrt(v)`` per parameter). The H100 run of 2026-11-22 measured 15.8 GB for gpt2 fp32
where saved activations and state add to 11.8 GB.

Two measurements give the peak, both without real memory:

- ``LiveBytesMeter``: a ``TorchDispatchMode`` that, op by op, adds the storages each op creates and
  drops those that have died since the op before (a weak reference per storage). Run over the fake
  forward and backward that ``memory_report`` already traces, on top of the state that is alive
  before the step, its maximum is the forward/backward peak.
- ``step_transients``: the engine's step (unscale, clip, master copies, the optimizer) runs for real
  on a stand-in model of shrunken twins of the parameters, at two sizes, under the same meter. Its
  temporaries grow linearly with the twins' size, whether the optimizer is a for-loop (the largest
  parameter), foreach (all of them) or fused (none), so two sizes extrapolate to the real one.

The step's peak is the larger of the two moments: the forward/backward, or the optimizer step on top
of the state after the backward. Kernel workspaces (cuBLAS, cuDNN) and the allocator's rounding and
fragmentation are not in it.

What the prediction assumes of the allocator, and so what it is checked against
(tests/test_memory_peak.py, on torch 2.13 and 2.15 in CI): a storage's bytes are taken when an op
makes it and given back when its last reference dies, exactly ``nbytes`` of them. That is torch's CPU
allocator (nothing cached: for the gpt case of the test the profiler's allocation events and the
meter agree to 44 bytes in 4.4 MB on both versions) and CUDA's
``memory_allocated`` (the caching allocator keeps freed blocks, but counts them free; it rounds a
block up to 512 bytes). It also assumes the real step runs the kernels the fake trace ran: the same
attention kernel, the same optimizer path. Memory held outside torch's allocator is not seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..engine import MixedPrecision

__all__ = ["LiveBytesMeter", "step_transients", "fake_step_peak"]

# Twins for the step probe hold at most this many elements in all, at the larger of two sizes.
_TWIN_ELEMENTS = 1 << 18


class LiveBytesMeter(TorchDispatchMode):
    """Bytes alive, op by op, on top of ``base``: ``peak`` is the most, ``current`` the bytes now.

    A storage counts from the op that creates it to the first op after it died (views and in-place
    results share an input's storage and add nothing). Works on fake tensors (their storages have sizes but no
    memory) and real ones. Memory made before the meter opened is the caller's ``base``.
    """

    def __init__(self, base: int = 0) -> None:
        super().__init__()
        self.base = base
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._bytes = 0
        self.peak = base

    @property
    def current(self) -> int:
        self._sweep()
        return self.base + self._bytes

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self._bytes -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()           # what died since the previous op died before this one's outputs
        # A view (weight.t(), x.view(...)) or an in-place result shares an input's storage: nothing new,
        # even when that storage was made before the meter opened (weights are in ``base``).
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata not in self._live and ref.cdata not in inputs:
                self._live[ref.cdata] = (ref, storage.nbytes())
                self._bytes += storage.nbytes()
        self.peak = max(self.peak, self.base + self._bytes)
        return out


class _Twins(nn.Module):
    """A stand-in model: shrunken 1-d twins of the real parameters, for the step probe."""

    def __init__(self, params: list[nn.Parameter], divisor: int) -> None:
        super().__init__()
        # Every parameter shrinks by the same factor (at least one element), so a for-loop step's
        # largest temporary and a foreach step's sum of them both shrink by it.
        self.twins = nn.ParameterList(
            nn.Parameter(torch.zeros(max(1, math.ceil(p.numel() / divisor))), requires_grad=p.requires_grad)
            for p in params)


def step_transients(recipe: Any, build: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                    params: Iterable[nn.Parameter], *, device_type: str = "cpu") -> int:
    """Bytes ``MixedPrecision.step()`` allocates above the state it starts from, at its peak.

    That is the optimizer's temporaries (a foreach Adam's ``sqrt(v)``), the engine's (fp32 gradient
    copies of a pure recipe, stochastic rounding's noise) and gradient copies that outlive the step.
    Measured for real on the CPU, on a stand-in model of shrunken twins of ``params`` under ``recipe``
    with the optimizer ``build(twins)``: a steady-state step (the second) at two twin sizes. Temporaries
    are ``a / divisor + b``, so the two give ``a + b``, the real size's. Norm layers kept fp32 by a pure
    recipe are twinned in its low precision (their parameters are a rounding error of the total).
    ``device_type="cuda"``: an optimizer left to torch's default (no ``foreach``/``fused`` given) runs
    foreach there, and is probed so.
    """
    params = list(params)
    total = sum(p.numel() for p in params if p.requires_grad)
    if not total:
        return 0
    small = max(1, math.ceil(total / _TWIN_ELEMENTS))      # the larger twins: at most ~256k elements
    measured = []
    for divisor in (small, 2 * small):
        model = _Twins(params, divisor)
        optimizer = build(list(model.parameters()))
        if device_type == "cuda":
            for group in optimizer.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
        mp = MixedPrecision(model, optimizer, recipe)
        for step in range(2):                               # the first step creates the state
            # Gradients of 2**-10 each (times the loss scale: finite at any scale), through
            # mp.backward as a user's would come, so the engine's usage checks see a real step.
            trainable = [t for t in model.parameters() if t.requires_grad]
            with mp.autocast():
                loss = torch.stack([t.float().sum() for t in trainable]).sum() * 2.0**-10
            mp.backward(loss)
            # Gradient copies the step keeps from the step before (fp32 master gradients) count too;
            # so does a small model's buffer of fp32 transients, kept between steps, that the step fills.
            kept = (mp.master.workspace_bytes if mp.master is not None else 0) or sum(
                m.grad.untyped_storage().nbytes() for m in (mp.master.masters if mp.master else [])
                if m.grad is not None)
            with LiveBytesMeter() as meter:
                mp.step()
            mp.zero_grad()
        measured.append(meter.peak + kept)
    # peak(d) = a / d + b at d = small and 2 small: a / small = 2 (p1 - p2), b = 2 p2 - p1.
    p1, p2 = measured
    return max(0, int(2 * (p1 - p2) * small + (2 * p2 - p1)))


def fake_step_peak(run: Callable[[], Any], base: int) -> tuple[Any, int]:
    """``run()`` (a fake forward and backward) under a ``LiveBytesMeter`` on top of ``base`` bytes:
    ``(its result, the peak)``."""
    with LiveBytesMeter(base) as meter:
        result = run()
    return result, meter.peak

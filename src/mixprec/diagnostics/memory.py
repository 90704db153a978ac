"""Where training memory goes: weights, gradients, master copies, optimizer state, saved activations.

Counted from the tensors themselves, so the story holds on every device (on CUDA the allocator's peak
is recorded beside it). Each storage is counted once, however many tensors view it::

    with SavedTensorMeter(model) as meter:
        loss = loss_fn(model(x), y)
        loss.backward()
    meter.bytes           # activations autograd kept for backward
    state_bytes(mp)       # MemoryBreakdown of parameters, gradients, masters, optimizer state

Storages are told apart by their StorageImpl (not their data pointer), so fake tensors, which have
sizes but no memory, are counted like real ones: ``memory_report`` (memory_report.py) predicts a step
that way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..step.grad_sync import local_shard

__all__ = ["MemoryBreakdown", "SavedTensorMeter", "state_bytes", "storage_bytes", "storage_key", "saved_by"]


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes by role. ``peak``: measured, the CUDA allocator's peak for the run (``None`` on other
    devices); predicted, the step's peak with its transients (diagnostics/memory_peak.py)."""

    params: int = 0          # the model's weights and buffers as held (fp16 in pure recipes)
    grads: int = 0           # gradients of the model's weights, plus the fp32 copies' gradients
    master: int = 0          # fp32 master weights held between steps
    optimizer: int = 0       # optimizer state (Adam's moments, momentum buffers, step counters)
    activations: int = 0     # tensors autograd saved for backward in one step
    peak: int | None = None

    @property
    def total(self) -> int:
        """The sum of the counted parts (not the allocator's peak)."""
        return self.params + self.grads + self.master + self.optimizer + self.activations


def storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    """Identifies the storage behind ``t``: views of one storage share it; works for fake tensors."""
    return t.device, StorageWeakRef(t.untyped_storage()).cdata


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and repeats counted once; meta: 0).

    A DTensor (FSDP2) counts its local shard: the bytes this rank holds.
    """
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        t = local_shard(t)
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes(engine) -> MemoryBreakdown:
    """Memory held by ``engine``'s model, gradients, master copies and optimizer, right now.

    Call it after ``step()`` and before ``zero_grad()`` to see the gradients too. Reads only tensor
    metadata: no sync, no copy.
    """
    model: nn.Module = engine.model
    masters = list(engine.master.masters) if engine.master is not None else []
    params = list(model.parameters()) + list(model.buffers())
    grads = [p.grad for p in model.parameters()] + [m.grad for m in masters]
    state = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if getattr(engine, "moments", None) is not None:    # compact Adam moments the engine holds
        state += engine.moments.tensors()
    return MemoryBreakdown(
        params=storage_bytes(params),
        grads=storage_bytes(grads),
        master=(storage_bytes(masters) if engine.master is not None and engine.master.keep
                else storage_bytes([kahan.comp]) if (kahan := getattr(engine.master, "kahan", None)) is not None
                else 0),      # bf16-kahan: the 16-bit compensations are its master copy's other half
        optimizer=storage_bytes(state),
    )


def _producer(t: torch.Tensor) -> str:
    """The op that made ``t``, as autograd names it without ``Backward0`` (``Addmm``, ``NativeLayerNorm``);
    ``cast`` for a dtype cast and ``cast of a weight`` for autocast's copy of a parameter; ``no grad_fn``
    for a tensor no differentiable op made (data, masks, indices, a norm's mean and rstd). A view
    counts as the tensor it views. A packed tensor (mixprec.casting.saved16) carries
    the name of the tensor it stands for."""
    named = getattr(t, "_mixprec_producer", None)
    if named is not None:
        return named
    while t._base is not None:      # a view (reshape, transpose, split): the tensor it views made it
        t = t._base
    fn = t.grad_fn
    if fn is None:
        return "no grad_fn"
    name = fn.name()
    if name.startswith("ToCopyBackward"):
        source = fn.next_functions[0][0] if fn.next_functions else None
        weight = source is not None and source.name() == "torch::autograd::AccumulateGrad"   # a leaf's cast
        return "cast of a weight" if weight else "cast"
    return name.rsplit("Backward", 1)[0] or name


def saved_by(groups: dict[tuple[str, str], int]) -> tuple[tuple[str, str, int], ...]:
    """``{(op, dtype): bytes}`` as ``((op, dtype, bytes), ...)``, largest first (ties by name)."""
    return tuple(sorted(((op, dt, b) for (op, dt), b in groups.items()), key=lambda g: (-g[2], g[0], g[1])))


def _in_backward() -> bool:
    """Whether autograd's engine is running a node on this thread (the backward, not the forward)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current is not None and current() is not None


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward while the context is open, by dtype and by op.

    Weights are not activations: storages of ``exclude`` (a module's parameters, fp32 copies) are
    left out. Autocast's low-precision copies of fp32 weights *are* counted: they are made for and
    kept by this step's backward. ``groups`` splits the bytes by ``(op that made the tensor, dtype)``:
    the fp32 tensors a 16-bit recipe still saves show up there by name.
    """

    def __init__(self, *exclude: nn.Module | Iterable[torch.Tensor]) -> None:
        self._excluded: set[tuple[torch.device, int]] = set()
        for item in exclude:
            tensors = item.parameters() if isinstance(item, nn.Module) else item
            self._excluded.update(storage_key(local_shard(t)) for t in tensors)
        self._saved: dict[tuple[torch.device, int], int] = {}
        self._kind: dict[tuple[torch.device, int], tuple[str, str]] = {}     # storage -> (op, dtype)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # A tensor saved while the backward runs (a recomputation: activation checkpointing, a chunked
        # loss) belongs to a graph that dies within the backward: a transient, not a saved activation.
        if t.device.type != "meta" and not _in_backward():
            key = storage_key(t)
            if key not in self._excluded:
                self._saved[key] = t.untyped_storage().nbytes()
                self._kind.setdefault(key, (_producer(t), str(t.dtype).removeprefix("torch.")))
        return t

    @property
    def bytes(self) -> int:
        return sum(self._saved.values())

    @property
    def groups(self) -> dict[tuple[str, str], int]:
        """Saved bytes by ``(op, dtype)``; each storage counted once, under the first tensor saved from it."""
        out: dict[tuple[str, str], int] = {}
        for key, nbytes in self._saved.items():
            out[self._kind[key]] = out.get(self._kind[key], 0) + nbytes
        return out

    @property
    def by_dtype(self) -> dict[str, int]:
        """Saved bytes by dtype name (``float32``, ``bfloat16`` ...)."""
        out: dict[str, int] = {}
        for (_, dtype), nbytes in self.groups.items():
            out[dtype] = out.get(dtype, 0) + nbytes
        return out

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

"""Opening a checkpoint without an engine: verify the file and say what it holds.

``save_checkpoint`` writes a header (magic, length, SHA-256) before ``torch.save``'s payload, so
``torch.load`` cannot open the file on its own. ``read_checkpoint`` checks the header and checksum,
loads the payload on the CPU and sums it up by role: which recipe trained it, how many steps it took,
the loss scale it stopped at, and the tensors of the model, the optimizer, the fp32 master copy, the
fp8 scales and the rest, with their element counts, bytes and dtypes::

    info = mixprec.read_checkpoint("run/step_1000.ckpt")
    info.recipe, info.steps, info.loss_scale     # ('fp16', 1000, 32768.0)
    print(info.summary())                        # what `mixprec ckpt show run/step_1000.ckpt` prints
    info.state["model"]                          # the payload itself: the state dicts as saved

Nothing here builds a model or touches the RNG; reading a file never changes anything.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from .verified import CheckpointError, read_verified
from .check import TOP_KEYS
from ..recipe import get_recipe

__all__ = ["read_checkpoint", "CheckpointInfo", "TensorGroup"]

# The payload's parts in the order the summary lists them, with the words it uses for each.
_ROLES = (("model", "model weights and buffers"), ("optimizer", "optimizer state"),
          ("master", "fp32 master weights"), ("fp8", "fp8 scales and amax histories"),
          ("moments", "compact Adam moments"), ("loss_scale", "loss scale and its counters"),
          ("scheduler", "LR scheduler"), ("rng", "RNG states"), ("extra", "your extras"))


@dataclasses.dataclass(frozen=True)
class TensorGroup:
    """The tensors one part of a checkpoint holds: how many, their elements and bytes, by dtype."""

    role: str
    tensors: int
    numel: int
    nbytes: int
    dtypes: dict[str, int]      # dtype name -> tensors of it


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a verified checkpoint holds. ``state`` is the payload as ``torch.load`` returned it."""

    path: Path
    file_bytes: int
    recipe: str
    steps: int | None            # step() calls, skipped ones included (None: no counter was saved)
    skipped: int | None
    loss_scale: float | None     # None: the recipe has no loss scale
    optimizer_type: str | None
    scheduler_type: str | None
    groups: tuple[TensorGroup, ...]
    state: dict[str, Any] = dataclasses.field(repr=False)

    def group(self, role: str) -> TensorGroup:
        """The ``TensorGroup`` of one role (``"model"``, ``"optimizer"``, ``"master"``, ...)."""
        for g in self.groups:
            if g.role == role:
                return g
        raise KeyError(f"no role {role!r}; the roles are {[g.role for g in self.groups]}")

    def summary(self) -> str:
        """A few lines for people: recipe, progress, loss scale, then one line per role that holds tensors."""
        scale = "none" if self.loss_scale is None else f"{self.loss_scale:g}"
        steps = "unknown" if self.steps is None else f"{self.steps} ({self.skipped} skipped)"
        lines = [f"{self.path}: mixprec checkpoint, {_size(self.file_bytes)}, checksum verified",
                 f"  recipe      {self.recipe}",
                 f"  steps       {steps}",
                 f"  loss scale  {scale}",
                 f"  optimizer   {self.optimizer_type or 'unknown'}"
                 + (f", scheduler {self.scheduler_type}" if self.scheduler_type else "")]
        words = dict(_ROLES)
        if "rounding=kahan" in self.recipe:     # bf16-kahan keeps no master: the low 16 bits of each value
            words["master"] = "Kahan compensations (int16)"
        for g in self.groups:
            if g.tensors:
                dtypes = ", ".join(f"{n} {d}" for d, n in sorted(g.dtypes.items()))
                lines.append(f"  {words[g.role]:<31} {g.tensors:>5} tensors {g.numel:>13,} elements "
                             f"{_size(g.nbytes):>9}  ({dtypes})")
        return "\n".join(lines)


def read_checkpoint(path: str | os.PathLike, *, weights_only: bool = True) -> CheckpointInfo:
    """Verify the checkpoint at ``path`` (header, length, SHA-256) and return what it holds.

    Tensors load on the CPU. ``weights_only=False`` lets extras hold arbitrary Python objects: only
    for files you trust. A missing, truncated or altered file is a ``CheckpointError`` naming the fault.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"read_checkpoint needs a file path (str or pathlib.Path), got {type(path).__name__}: "
                        "call read_checkpoint('run/step_1000.ckpt')")
    if not isinstance(weights_only, bool):
        raise TypeError(f"read_checkpoint(weights_only=...) takes True or False, got {weights_only!r}")
    path = Path(path)
    state = read_verified(path, torch.device("cpu"), weights_only)
    if not isinstance(state, dict) or set(TOP_KEYS) - set(state):
        have = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: the checksum holds but the payload is {have}, not what "
                              f"save_checkpoint writes ({', '.join(TOP_KEYS)})")
    engine = state["mixprec"]
    # The summary reads the engine's part and its loss scale by key: anything else is not save_checkpoint's.
    odd = ("mixprec", engine) if not isinstance(engine, dict) else ("loss scale", engine.get("loss_scale") or {})
    if not isinstance(odd[1], dict):
        raise CheckpointError(f"{path}: the checksum holds but the payload's {odd[0]} part is "
                              f"{type(odd[1]).__name__}, not the dict save_checkpoint writes")
    engine_parts = {"master": engine.get("master"), "fp8": engine.get("fp8"), "moments": engine.get("moments"),
                    "loss_scale": engine.get("loss_scale")}
    sources = {**{k: state[k] for k in ("model", "optimizer", "scheduler", "rng", "extra")}, **engine_parts}
    groups = tuple(_group(role, sources[role]) for role, _ in _ROLES)
    scale = engine.get("loss_scale") or {}
    recipe = str(engine.get("recipe", "unknown"))
    value = scale.get("value")
    return CheckpointInfo(
        path=path, file_bytes=path.stat().st_size, recipe=recipe,
        steps=_int(scale.get("steps")), skipped=_int(scale.get("skipped")),
        loss_scale=float(value) if _scalar(value) and _scaled(recipe) else None,
        optimizer_type=state.get("optimizer_type"), scheduler_type=state.get("scheduler_type"),
        groups=groups, state=state)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _group(role: str, obj: Any) -> TensorGroup:
    tensors = _tensors(obj)
    dtypes: dict[str, int] = {}
    for t in tensors:
        name = str(t.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + 1
    return TensorGroup(role, len(tensors), sum(t.numel() for t in tensors),
                       sum(t.numel() * t.element_size() for t in tensors), dtypes)


def _scaled(recipe: str) -> bool:
    """Whether the recipe multiplies the loss (else the saved value is the constant 1 of "no scale")."""
    try:
        return get_recipe(recipe).loss_scale.kind != "none"
    except (ValueError, TypeError):    # a recipe this version cannot parse: show what was saved
        return True


def _scalar(value: Any) -> bool:
    """A one-element tensor (what the loss scale saves); anything else in a crafted file is not shown."""
    return torch.is_tensor(value) and value.numel() == 1


def _int(value: Any) -> int | None:
    return int(value) if _scalar(value) or isinstance(value, int) else None


def _size(nbytes: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= div:
            return f"{nbytes / div:.1f} {unit}"
    return f"{nbytes} B"

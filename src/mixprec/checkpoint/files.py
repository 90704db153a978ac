"""Saving and loading an engine's run: what a checkpoint holds, and a restore that fails whole or not at all.

A checkpoint holds the model, the optimizer, everything the engine owns (loss scale and its counters,
fp32 master weights, the stochastic-rounding generator), an optional LR scheduler, the RNG states of
torch, CUDA, ``random`` and NumPy, and the user's extras::

    save_checkpoint("run/step_1000.ckpt", mp, scheduler=sched, extra={"step": 1000})
    extra = load_checkpoint("run/step_1000.ckpt", mp, scheduler=sched)

The arguments are checked before anything is serialised. The file itself (header, checksum, atomic
write) is ``verified.py``'s. A load checks the whole payload first (``check.py``) and restores from a
snapshot if anything still fails: a failed load changes nothing.
"""

from __future__ import annotations

import copy
import io
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .check import check_fits
from .verified import CheckpointError, _check_file_path, read_verified, write_verified
from ..engine import MixedPrecision

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(path: str | os.PathLike, engine: MixedPrecision, *, scheduler: Any = None,
                    extra: Any = None, rng: bool = True) -> Path:
    """Write everything needed to resume ``engine``'s run to ``path``, atomically. Syncs with the host.

    The arguments are checked before anything is serialised: a swapped ``(engine, path)``, a bare
    model, an optimizer passed as ``scheduler=``, a scheduler of another optimizer, a path that names
    a folder, an ``extra`` that cannot be pickled: each a TypeError/ValueError naming the fix.
    """
    _check_call("save_checkpoint", path, engine)
    _check_flags("save_checkpoint", rng=rng)
    _check_scheduler_arg("save_checkpoint", scheduler, engine)
    _check_extra(extra)
    _check_file_path(path)
    state = {
        "model": engine.model.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "optimizer_type": type(engine.optimizer).__name__,   # an AdamW state must not load into an SGD
        "mixprec": engine.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scheduler_type": type(scheduler).__name__ if scheduler is not None else None,
        "rng": _rng_state() if rng else None,
        "extra": extra,
    }
    return write_verified(path, state)


def _check_call(name: str, path: Any, engine: Any) -> None:
    """TypeError for the two common slips: ``(engine, path)`` swapped, and a model in place of the engine."""
    if isinstance(path, MixedPrecision) and isinstance(engine, (str, os.PathLike)):
        raise TypeError(f"{name} takes the path first: call {name}(path, engine), not {name}(engine, path)")
    if not isinstance(engine, MixedPrecision):
        got = type(engine).__name__
        if isinstance(engine, torch.nn.Module):
            raise TypeError(f"{name} needs the MixedPrecision engine, got the bare model ({got}): pass the "
                            f"engine that wraps it, {name}(path, mp) with mp = MixedPrecision(model, "
                            "optimizer, recipe); it saves and restores model, optimizer and loss scale together")
        raise TypeError(f"{name} needs the MixedPrecision engine as its second argument, got {got}: "
                        f"call {name}(path, mp)")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} needs a file path (str or pathlib.Path) as its first argument, got "
                        f"{type(path).__name__}: call {name}('run/step_1000.ckpt', mp)")


def _check_flags(name: str, **flags: Any) -> None:
    """TypeError for a switch that is not a bool: ``rng="no"`` is truthy, and would save or restore RNG states."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}({flag}=...) takes True or False, got {type(value).__name__} {value!r}")


def _check_scheduler_arg(name: str, scheduler: Any, engine: MixedPrecision) -> None:
    """``scheduler=`` must be an LR scheduler (state_dict/load_state_dict) of the engine's own optimizer."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.Optimizer):
        raise TypeError(f"{name}(scheduler=...) got an optimizer ({type(scheduler).__name__}): the engine "
                        "saves its optimizer itself; pass the LR scheduler (e.g. a "
                        "torch.optim.lr_scheduler.LambdaLR), or leave scheduler= out")
    if not (callable(getattr(scheduler, "state_dict", None))
            and callable(getattr(scheduler, "load_state_dict", None))):
        raise TypeError(f"{name}(scheduler=...) got a {type(scheduler).__name__}, which has no "
                        "state_dict()/load_state_dict(): pass an LR scheduler (torch.optim.lr_scheduler.*), "
                        "or keep your own object's state in extra=")
    bound = getattr(scheduler, "optimizer", None)
    if isinstance(bound, torch.optim.Optimizer) and bound is not engine.optimizer:
        raise ValueError(f"{name}(scheduler=...) got a {type(scheduler).__name__} bound to another "
                         "optimizer than the engine's: build the scheduler on mp.optimizer (the one "
                         "passed to MixedPrecision)")


def _check_extra(extra: Any) -> None:
    """Pickle ``extra`` alone first: a lambda or an open file fails here, named, not inside the payload."""
    if extra is None:
        return
    try:
        torch.save(extra, io.BytesIO())
    except Exception as exc:    # pickle raises PicklingError, AttributeError or TypeError by object kind
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise TypeError(f"save_checkpoint(extra=...) holds something that cannot be pickled ({detail}): "
                        "keep extras to tensors, numbers, strings, lists and dicts (objects of "
                        "module-level classes work too, loaded with weights_only=False); store a "
                        "function by name, not the function") from None


def load_checkpoint(path: str | os.PathLike, engine: MixedPrecision, *, scheduler: Any = None,
                    rng: bool = True, weights_only: bool = True, ignore_scheduler: bool = False) -> Any:
    """Verify ``path`` and restore it into ``engine`` (and ``scheduler``); returns the saved extras.

    A bad or misfitting file changes nothing, twice over. The checksum is checked before anything is
    unpickled, and everything the file holds is checked against the engine (model keys, shapes and
    dtypes, the recipe, the loss scale and its values, master weights, fp8 state, the optimizer's
    type, groups, settings and per-parameter state, the scheduler both ways, the RNG states:
    ``check.py``) before the first tensor is copied. And the restore itself runs against a
    snapshot of everything it touches (model, engine, optimizer, scheduler, RNG states; tensors
    copied to the CPU): any failure part way puts all of it back before the error is raised.
    A file that holds scheduler state must be loaded with ``scheduler=`` (or ``ignore_scheduler=True``).
    ``weights_only=False`` lets extras hold arbitrary Python objects: only for files you trust.
    """
    _check_call("load_checkpoint", path, engine)
    _check_flags("load_checkpoint", rng=rng, weights_only=weights_only, ignore_scheduler=ignore_scheduler)
    _check_scheduler_arg("load_checkpoint", scheduler, engine)
    path = Path(path)
    state = read_verified(path, engine.device, weights_only)
    try:
        check_fits(state, engine, scheduler, ignore_scheduler=ignore_scheduler)
    except ValueError as exc:
        raise CheckpointError(f"{path}: does not fit this model/optimizer/recipe: {exc}") from None
    snapshot = _Snapshot(engine, scheduler, rng)
    try:
        engine.model.load_state_dict(state["model"])
        engine.load_state_dict(state["mixprec"])
        engine.optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if rng and state["rng"] is not None:
            _set_rng_state(state["rng"])
    except Exception as exc:   # a misfit the checks do not know yet: put everything back
        try:
            snapshot.restore()
        except Exception as again:
            raise CheckpointError(f"{path}: restoring failed after every check passed ({exc}), and putting "
                                  f"the engine back failed too ({again}): it may be partly restored: "
                                  "rebuild it before training on, and report this as a mixprec bug") from exc
        raise CheckpointError(f"{path}: restoring failed after every check passed ({exc}); the model, "
                              "optimizer, engine, scheduler and RNG states were put back as they were. "
                              "Report this as a mixprec bug, with the file") from exc
    return state["extra"]


class _Snapshot:
    """What ``load_checkpoint`` may change, kept so a failed restore can be undone bit for bit.

    Tensors are copied to the CPU (the loaded file already holds one device copy; a second would
    double the peak). The optimizer's ``state`` and ``param_groups`` are kept by reference:
    ``Optimizer.load_state_dict`` builds new ones and never writes into the old.
    """

    def __init__(self, engine: MixedPrecision, scheduler: Any, rng: bool) -> None:
        self.engine, self.scheduler = engine, scheduler
        self.model = {k: _cpu_copy(v) for k, v in engine.model.state_dict().items()}
        self.mixprec = _cpu_copy(engine.state_dict())
        self.opt_state, self.opt_groups = engine.optimizer.state, engine.optimizer.param_groups
        self.opt_group_items = [dict(g) for g in engine.optimizer.param_groups]
        self.sched_dict = dict(scheduler.__dict__) if scheduler is not None else None
        self.sched_state = _cpu_copy(scheduler.state_dict()) if scheduler is not None else None
        self.rng = _rng_snapshot() if rng else None

    def restore(self) -> None:
        engine = self.engine
        with torch.no_grad():
            for key, tensor in engine.model.state_dict().items():
                tensor.copy_(self.model[key])
        engine.load_state_dict(self.mixprec)
        engine.optimizer.state, engine.optimizer.param_groups = self.opt_state, self.opt_groups
        for group, items in zip(self.opt_groups, self.opt_group_items):
            group.clear()
            group.update(items)
        if self.scheduler is not None:
            self.scheduler.__dict__.clear()
            self.scheduler.__dict__.update(self.sched_dict)
            self.scheduler.load_state_dict(self.sched_state)
        if self.rng is not None:
            _restore_rng(self.rng)


def _cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor cloned to the CPU (dicts, lists and tuples rebuilt, the rest copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _rng_snapshot() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _restore_rng(saved: tuple) -> None:
    cpu, cuda, python, numpy_state = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    np.random.set_state(numpy_state)


def _rng_state() -> dict[str, Any]:
    version, keys, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": [version, list(keys), gauss],
        # Plain types only, so the file loads with weights_only=True.
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))

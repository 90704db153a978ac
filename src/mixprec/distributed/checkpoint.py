"""Checkpoints of a run on several ranks (DDP or FSDP2) that resume bit for bit.

Call both functions on every rank, with the same path::

    save_distributed_checkpoint("run/step_1000", mp, scheduler=sched, extra={"step": 1000})
    extra = load_distributed_checkpoint("run/step_1000", mp, scheduler=sched)

- **DDP** (replicated): every rank holds the same model, optimizer and engine state, so rank 0 writes
  one ordinary ``save_checkpoint`` file (atomic, checksummed, verified on load); only the RNG states
  differ per rank, so all of them are gathered into it and each rank restores its own.
- **FSDP2** (sharded): ``path`` is a folder. The sharded model and optimizer go through
  ``torch.distributed.checkpoint`` (each rank writes its shards, a resume on another world size
  reshards); each rank's own part (loss scale, its RNG states, scheduler, extras) goes into
  ``rank{r}.mixprec``, checksummed like ``save_checkpoint``'s files. The folder is written under a
  temporary name and renamed into place once every rank is done, so a crash leaves the old one whole.

Both sync with the host and block on collectives (barriers, gathers): call them between steps.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..checkpoint.files import _rng_state, _set_rng_state, load_checkpoint, save_checkpoint
from ..checkpoint.verified import CheckpointError, read_verified, write_verified
from ..checkpoint.check import check_engine_state
from ..step.grad_sync import SyncKind
from ..engine import MixedPrecision

__all__ = ["save_distributed_checkpoint", "load_distributed_checkpoint"]


def save_distributed_checkpoint(path: str | os.PathLike, engine: MixedPrecision, *, scheduler: Any = None,
                                extra: Any = None) -> Path:
    """Write ``engine``'s run from every rank to ``path`` (a file under DDP, a folder under FSDP2)."""
    kind = _kind(engine)
    path = Path(path)
    group = engine.grad_sync.group
    if kind is SyncKind.REPLICATED:
        rngs: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(rngs, _rng_state(), group=group)
        if dist.get_rank(group) == 0:
            save_checkpoint(path, engine, scheduler=scheduler, rng=False,
                            extra={"user": extra, "rng_by_rank": rngs})
        dist.barrier(group=group)
        return path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    partial = path.with_name(f".{path.name}.partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)     # a crashed earlier save
        partial.mkdir(parents=True)
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=partial, process_group=group)
    write_verified(partial / f"rank{rank}.mixprec", {
        "world_size": world, "mixprec": engine.state_dict(), "rng": _rng_state(), "extra": extra,
        "scheduler": scheduler.state_dict() if scheduler is not None else None})
    dist.barrier(group=group)
    if rank == 0:
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return path


def load_distributed_checkpoint(path: str | os.PathLike, engine: MixedPrecision, *, scheduler: Any = None,
                                weights_only: bool = True, ignore_scheduler: bool = False) -> Any:
    """Restore what ``save_distributed_checkpoint`` wrote into ``engine`` on every rank; returns extras.

    As ``load_checkpoint``: the recipe, the engine's state and the scheduler (both ways) are checked
    before anything is restored; ``ignore_scheduler=True`` drops saved scheduler state on purpose.
    """
    kind = _kind(engine)
    path = Path(path)
    group = engine.grad_sync.group
    rank = dist.get_rank(group)
    if kind is SyncKind.REPLICATED:
        saved = load_checkpoint(path, engine, scheduler=scheduler, rng=False, weights_only=weights_only,
                                ignore_scheduler=ignore_scheduler)
        if not isinstance(saved, dict) or "rng_by_rank" not in saved:
            raise CheckpointError(f"{path}: written by save_checkpoint on one rank, not by "
                                  "save_distributed_checkpoint; load it with load_checkpoint")
        rngs = saved["rng_by_rank"]
        # Another world size: weights and optimizer are restored, the per-rank RNG streams cannot be.
        if len(rngs) == dist.get_world_size(group):
            _set_rng_state(rngs[rank])
        return saved["user"]

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    own = path / f"rank{rank}.mixprec"
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a finished FSDP2 checkpoint folder (no .metadata)")
    state = read_verified(own, engine.device, weights_only)
    try:        # before dcp.load writes into the shards: a misfit changes nothing
        check_engine_state(engine, state["mixprec"])
        if scheduler is None and state["scheduler"] is not None and not ignore_scheduler:
            raise ValueError("holds LR scheduler state but no scheduler was passed: pass scheduler=... "
                             "to resume it, or ignore_scheduler=True to drop it on purpose")
        if scheduler is not None and state["scheduler"] is None:
            raise ValueError("holds no LR scheduler state, but a scheduler was passed")
    except ValueError as exc:
        raise CheckpointError(f"{path}: does not fit this model/optimizer/recipe: {exc}") from None
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    sharded = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp.load(sharded, checkpoint_id=path, process_group=group)
        set_state_dict(engine.model, engine.optimizer, model_state_dict=sharded["model"],
                       optim_state_dict=sharded["optimizer"])
        engine.load_state_dict(state["mixprec"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: does not fit this model/optimizer/recipe: {exc}") from exc
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if state["world_size"] == dist.get_world_size(group):
        _set_rng_state(state["rng"])
    return state["extra"]


def _kind(engine: MixedPrecision) -> SyncKind:
    if not isinstance(engine, MixedPrecision):
        raise TypeError(f"needs the MixedPrecision engine, got {type(engine).__name__}")
    kind = engine.grad_sync.kind
    if kind is SyncKind.LOCAL:
        raise ValueError("this engine runs on one process: use save_checkpoint/load_checkpoint")
    return kind

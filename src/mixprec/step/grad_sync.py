"""Mixed precision across processes: DDP and FSDP2 with every recipe, skips and clipping in lockstep.

If one rank sees an overflow and another does not, both must still skip that step, or their weights
part for good (pytorch/pytorch#115710). The engine reads the gradients once per step for a sum of
squares; here that one number is combined across ranks with **one** ``all_reduce`` and no host sync:

- **sharded** (FSDP2, ``fully_shard``): each rank holds a different slice of every gradient, so the
  global sum of squares is the SUM of the per-rank sums. A NaN or inf on any rank poisons the sum
  (squares are >= 0, so no inf - inf can cancel it), so the result is also the shared overflow flag.
- **replicated** (DDP): after backward every rank holds the same averaged gradients, so the norm is
  already global and summing would count it ``world`` times. Ranks take the MAX instead, with a
  non-finite value first mapped to +inf (a MAX may drop a NaN): equal inputs give the exact value
  back, and any rank's overflow becomes everyone's. Under ``no_sync()`` accumulation the gradients
  are only averaged at the last micro-batch's backward, which is before ``step()``, so this holds.

Every rank then sees the same flag and the same norm, skips or steps together, clips by the same
factor and makes the same loss-scale update.

How each recipe maps onto FSDP2's own ``MixedPrecisionPolicy`` (``shard_model`` applies it):

==========  ===================================  =============================================
recipe      FSDP2 policy (param / reduce dtype)  what mixprec still does
==========  ===================================  =============================================
fp32, tf32  none: fp32 gathers, fp32 reduce      overflow check, clipping, in lockstep
fp16, bf16  none: fp32 gathers, fp32 reduce      autocast per op, loss scale (fp16)
fp16-pure   fp16 / fp32; norms fp32 / fp32       loss scale; the sharded fp32 parameters *are*
bf16-pure   bf16 / fp32; norms fp32 / fp32       the master copy (no MasterWeights is built)
bf16-sr     not supported yet (ValueError)       use bf16-pure
==========  ===================================  =============================================

Sharding and DDP wrapping live in ``mixprec.distributed`` (``shard_model``, ``wrap_ddp``).
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..recipe import Recipe, Rounding

__all__ = ["GradSync", "SyncKind", "GroupChoice", "local_shard", "check_installable"]

_FSDP_RECIPE_ATTR = "_mixprec_fsdp_recipe"   # set on the root by shard_model, read by the engine


class SyncKind(enum.Enum):
    """How one rank's gradients relate to the others'."""

    LOCAL = "local"            # a single process, or a model trained on its own
    REPLICATED = "replicated"  # DDP: every rank holds the same averaged gradients
    SHARDED = "sharded"        # FSDP2: every rank holds a different slice of each gradient


class GroupChoice(str, enum.Enum):
    """The word ``MixedPrecision(process_group=...)`` takes besides a group or None (``"auto"`` works too)."""

    AUTO = "auto"   # FSDP2 (DTensor parameters) and DDP modules are detected; a plain model stays local


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


class GradSync:
    """Combines each rank's sum of squared gradients into the global one: one all_reduce, no sync.

    ``GradSync.for_model(model, process_group)`` picks the kind: DTensor parameters (FSDP2) are
    sharded over their mesh; a DDP-wrapped model is replicated over its group; a plain model is
    local until ``wrap_ddp(engine)`` makes it replicated (the "build the engine, then wrap in DDP"
    order pure recipes need), or replicated over ``process_group`` when one is given.
    """

    def __init__(self, kind: SyncKind, group: Any = None) -> None:
        self.kind = kind
        self.group = group

    @property
    def world_size(self) -> int:
        return 1 if self.kind is SyncKind.LOCAL else dist.get_world_size(self.group)

    @property
    def fsdp(self) -> bool:
        return self.kind is SyncKind.SHARDED

    @classmethod
    def for_model(cls, model: nn.Module, recipe: Recipe, process_group: Any = GroupChoice.AUTO) -> GradSync:
        params = list(model.parameters())
        dtensors = [p for p in params if _is_dtensor(p)]
        if dtensors:
            if len(dtensors) != len(params):
                plain = [n for n, p in model.named_parameters() if not _is_dtensor(p)][:3]
                raise ValueError(f"parameters {plain} are not sharded while others are: apply "
                                 "fully_shard to the root module too (shard_model does)")
            meshes = {id(p.device_mesh) for p in dtensors}
            mesh = dtensors[0].device_mesh
            if len(meshes) > 1 or mesh.ndim != 1:
                raise ValueError("mixprec supports FSDP2 on one 1-D device mesh; HSDP (2-D meshes) "
                                 "and several meshes are not supported yet")
            _check_fsdp_recipe(model, recipe)
            return cls(SyncKind.SHARDED, mesh.get_group() if process_group in (GroupChoice.AUTO, None)
                       else process_group)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            if recipe.param.is_low:
                raise ValueError(f"recipe {recipe.label!r} casts the weights, which detaches them from "
                                 "DDP's gradient hooks: build MixedPrecision on the plain model first, "
                                 "then wrap it with mixprec.distributed.wrap_ddp(mp)")
            group = model.process_group if process_group == GroupChoice.AUTO else process_group
            return cls(SyncKind.REPLICATED, group) if group is not None else cls(SyncKind.LOCAL)
        # A plain model stays local under AUTO, even with a process group up: a collective every
        # step would hang a loop that runs on some ranks only. wrap_ddp switches the engine over.
        if process_group in (GroupChoice.AUTO, None):
            return cls(SyncKind.LOCAL)
        return cls(SyncKind.REPLICATED, process_group)

    def reduce_sum_squares(self, sq_f32: torch.Tensor) -> torch.Tensor:
        """Global sum of squares from this rank's ``sq_f32`` (a () fp32 tensor). One collective, no sync.

        The collective is enqueued on the device stream (NCCL) or run in place (gloo); nothing is
        read back to the host.
        """
        if self.kind is SyncKind.LOCAL:
            return sq_f32
        if self.kind is SyncKind.SHARDED:
            total = sq_f32.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
            return total
        # Replicated: map NaN to +inf first, so MAX cannot lose it; equal finite inputs come back exact.
        total = torch.where(torch.isfinite(sq_f32), sq_f32, torch.full_like(sq_f32, float("inf")))
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        return total


def check_installable(current: GradSync, sync: Any) -> None:
    """Refuse ``engine.install_grad_sync(sync)``: ``sync`` is not a GradSync, or the engine's ``current``
    one already reduces over ranks (a GradSync is installed once, on an engine built on the plain model)."""
    if not isinstance(sync, GradSync):
        raise TypeError(f"install_grad_sync takes a GradSync, got {type(sync).__name__}")
    if current.kind is not SyncKind.LOCAL:
        raise ValueError(f"this engine already reduces over ranks ({current.kind.value}); "
                         "a GradSync is installed once, on an engine built on the plain model")


def _check_fsdp_recipe(model: nn.Module, recipe: Recipe) -> None:
    if recipe.rounding is Rounding.STOCHASTIC:
        raise ValueError("bf16-sr (stochastic rounding, no master copy) is not supported under FSDP2 yet: "
                         "use bf16-pure, whose sharded fp32 master costs 4 B/param divided by the ranks")
    if recipe.rounding is Rounding.KAHAN:
        raise ValueError("bf16-kahan (bf16 weights + compensations, no master copy) is not supported under "
                         "FSDP2 yet: use bf16-pure, whose sharded fp32 master costs 4 B/param divided by the ranks")
    sharded_as = getattr(model, _FSDP_RECIPE_ATTR, None)
    if recipe.param.is_low and sharded_as != str(recipe):
        raise ValueError(
            f"recipe {recipe.label!r} gathers the weights in {recipe.param.value}, which FSDP2 must do: "
            f"shard the model with mixprec.distributed.shard_model(model, {recipe.label!r}, mesh=...) "
            f"instead of calling fully_shard yourself" + (f" (it was sharded for {sharded_as!r})"
                                                          if sharded_as else ""))

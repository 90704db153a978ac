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

``comm_dtype="bf16"`` or ``"fp16"`` halves gradient traffic: FSDP2 reduce-scatters in that dtype and
accumulates the result into fp32 sharded gradients; DDP gets torch's bf16/fp16 compression hook (the
bucket is cast down, all-reduced, cast back into the gradients' own dtype, fp32 for every recipe but
the pure ones, and accumulation happens there).

    >>> mesh = init_device_mesh("cpu", (world,))              # doctest: +SKIP
    >>> model = shard_model(model, "bf16-pure", mesh=mesh)     # doctest: +SKIP
    >>> mp = MixedPrecision(model, AdamW(model.parameters(), fused=True), "bf16-pure")  # doctest: +SKIP
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .casting import keeps_fp32
from .recipe import Recipe, Rounding, get_recipe

__all__ = ["GradSync", "SyncKind", "local_shard", "fsdp_policy", "shard_model", "wrap_ddp",
           "COMM_DTYPES"]

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FSDP_RECIPE_ATTR = "_mixprec_fsdp_recipe"   # set on the root by shard_model, read by the engine


class SyncKind(enum.Enum):
    """How one rank's gradients relate to the others'."""

    LOCAL = "local"            # a single process, or a model trained on its own
    REPLICATED = "replicated"  # DDP: every rank holds the same averaged gradients
    SHARDED = "sharded"        # FSDP2: every rank holds a different slice of each gradient


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
    def for_model(cls, model: nn.Module, recipe: Recipe, process_group: Any = "auto") -> GradSync:
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
            return cls(SyncKind.SHARDED, mesh.get_group() if process_group in ("auto", None)
                       else process_group)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            if recipe.param.is_low:
                raise ValueError(f"recipe {recipe.label!r} casts the weights, which detaches them from "
                                 "DDP's gradient hooks: build MixedPrecision on the plain model first, "
                                 "then wrap it with mixprec.distributed.wrap_ddp(mp)")
            group = model.process_group if process_group == "auto" else process_group
            return cls(SyncKind.REPLICATED, group) if group is not None else cls(SyncKind.LOCAL)
        # A plain model stays local under "auto", even with a process group up: a collective every
        # step would hang a loop that runs on some ranks only. wrap_ddp switches the engine over.
        if process_group in ("auto", None):
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


def _check_fsdp_recipe(model: nn.Module, recipe: Recipe) -> None:
    if recipe.rounding is Rounding.STOCHASTIC:
        raise ValueError("bf16-sr (stochastic rounding, no master copy) is not supported under FSDP2 yet: "
                         "use bf16-pure, whose sharded fp32 master costs 4 B/param divided by the ranks")
    sharded_as = getattr(model, _FSDP_RECIPE_ATTR, None)
    if recipe.param.is_low and sharded_as != str(recipe):
        raise ValueError(
            f"recipe {recipe.label!r} gathers the weights in {recipe.param.value}, which FSDP2 must do: "
            f"shard the model with mixprec.distributed.shard_model(model, {recipe.label!r}, mesh=...) "
            f"instead of calling fully_shard yourself" + (f" (it was sharded for {sharded_as!r})"
                                                          if sharded_as else ""))


def fsdp_policy(recipe: str | Recipe, *, comm_dtype: str | None = None, keep_fp32: bool = False):
    """FSDP2's ``MixedPrecisionPolicy`` for ``recipe`` (``keep_fp32``: for a module the recipe keeps fp32).

    Pure recipes gather in their param dtype and reduce in fp32 (the fp32 sharded parameters are the
    master copy); every other recipe gathers fp32 (autocast casts per op). ``comm_dtype`` sets the
    reduce dtype: bf16/fp16 halve the traffic, the reduced gradient still lands in fp32 shards.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    recipe = get_recipe(recipe)
    reduce_dtype = _comm_dtype(comm_dtype)
    param_dtype = recipe.param.dtype if recipe.param.is_low and not keep_fp32 else None
    # fp32 is the sharded parameters' own dtype: asking for it is the same as not casting at all.
    if param_dtype is not None and reduce_dtype is None:
        reduce_dtype = torch.float32
    # mixprec's casting hooks cast inputs (and norms' inputs up to fp32): FSDP should not also do it.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                cast_forward_inputs=False)


def shard_model(model: nn.Module, recipe: str | Recipe, *, mesh: Any = None,
                comm_dtype: str | None = None, units: tuple[type[nn.Module], ...] | None = None) -> nn.Module:
    """Apply FSDP2's ``fully_shard`` to ``model`` with the recipe's policy; returns ``model``.

    Each module the recipe keeps fp32 (norms, for pure recipes) becomes its own FSDP unit with fp32
    gathers; each module of a type in ``units`` (default: the root's direct children with parameters)
    becomes a unit gathered in the param dtype; the root gathers whatever is left. Build the optimizer
    and ``MixedPrecision`` afterwards, from the sharded parameters. ``mesh`` defaults to a 1-D mesh
    over all ranks on the current device type.
    """
    from torch.distributed.fsdp import fully_shard

    recipe = get_recipe(recipe)
    if recipe.rounding is Rounding.STOCHASTIC:
        _check_fsdp_recipe(model, recipe)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        if not dist.is_initialized():
            raise ValueError("shard_model needs torch.distributed initialized: call "
                             "dist.init_process_group(...) first (torchrun sets the environment)")
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    main = fsdp_policy(recipe, comm_dtype=comm_dtype)
    kept = fsdp_policy(recipe, comm_dtype=comm_dtype, keep_fp32=True)
    if recipe.param.is_low:
        for module in model.modules():
            if module is not model and keeps_fp32(module, recipe) and _has_params(module):
                fully_shard(module, mesh=mesh, mp_policy=kept)
    for name, child in model.named_children():
        chosen = [m for m in child.modules() if isinstance(m, units)] if units else [child]
        for module in reversed(chosen):   # innermost first: fully_shard nests from the leaves up
            if not (recipe.param.is_low and keeps_fp32(module, recipe)) and _has_params(module):
                fully_shard(module, mesh=mesh, mp_policy=main)
    fully_shard(model, mesh=mesh, mp_policy=main)
    setattr(model, _FSDP_RECIPE_ATTR, str(recipe))
    return model


def wrap_ddp(engine: Any, *, comm_dtype: str | None = None, process_group: Any = None,
             **ddp_kwargs: Any) -> nn.Module:
    """Wrap ``engine.model`` (already prepared by MixedPrecision) in DDP; returns the DDP module.

    Build ``MixedPrecision`` on the plain model first (pure recipes cast the weights, which must happen
    before DDP registers its gradient hooks), then call this. DDP broadcasts rank 0's weights; the fp32
    master copies are broadcast here too, so every rank starts from the same masters. ``comm_dtype``
    ("bf16"/"fp16") registers torch's compression hook: the all-reduce runs in 16 bits, the result is
    cast back into the gradients' own dtype. From here on the engine reduces its norm and overflow
    flag over the same group (default: all ranks). Forward through the returned module.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        raise ValueError("wrap_ddp needs torch.distributed initialized: call dist.init_process_group(...) "
                         "first (torchrun sets the environment)")
    if engine.grad_sync.kind is SyncKind.SHARDED or isinstance(engine.model, DDP):
        raise ValueError("wrap_ddp takes an engine built on the plain model; this one's model is "
                         f"{'sharded by FSDP2' if engine.grad_sync.fsdp else 'already wrapped in DDP'}")
    dtype = _comm_dtype(comm_dtype)
    group = process_group if process_group is not None else dist.group.WORLD
    model = DDP(engine.model, process_group=group, **ddp_kwargs)
    engine.grad_sync = GradSync(SyncKind.REPLICATED, group)
    if engine.master is not None and engine.master.keep:
        with torch.no_grad():
            for m in engine.master.masters:
                dist.broadcast(m.data, src=dist.get_global_rank(engine.grad_sync.group, 0)
                               if engine.grad_sync.group not in (None, dist.group.WORLD) else 0,
                               group=engine.grad_sync.group)
    if dtype in (torch.float16, torch.bfloat16):
        model.register_comm_hook(engine.grad_sync.group, _compress_hook(dtype, engine.device))
    return model


def _compress_hook(dtype: torch.dtype, device: torch.device):
    """torch's DDP hook that all-reduces a gradient bucket in ``dtype`` (divided by the world first).

    torch registers its bf16 hook only for CUDA+NCCL (it checks the function's name); on other
    backends the same torch implementation is reached through ``_compress_hook`` under another name.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if dtype == torch.float16:
        return default_hooks.fp16_compress_hook
    if device.type == "cuda":
        return default_hooks.bf16_compress_hook

    def bf16_all_reduce_hook(group, bucket):
        return default_hooks._compress_hook(torch.bfloat16, group, bucket)
    return bf16_all_reduce_hook


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _comm_dtype(word: str | None) -> torch.dtype | None:
    if word is None:
        return None
    try:
        return COMM_DTYPES[word]
    except KeyError:
        raise ValueError(f"unknown comm_dtype {word!r}; valid values: {', '.join(COMM_DTYPES)}") from None

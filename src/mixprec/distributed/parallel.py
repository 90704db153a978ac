"""Preparing a model for several processes: FSDP2 sharding with the recipe's policy, and DDP.

The lockstep itself (one all_reduce of the gradient norm, shared skips) is the engine's, in
``mixprec.step.grad_sync``; here the model is sharded or wrapped so that the engine can find it.

    >>> mesh = init_device_mesh("cpu", (world,))              # doctest: +SKIP
    >>> model = shard_model(model, "bf16-pure", mesh=mesh)     # doctest: +SKIP
    >>> mp = MixedPrecision(model, AdamW(model.parameters(), fused=True), "bf16-pure")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..casting.model import keeps_fp32
from ..fp8.fsdp_weight import Fp8GatherScales, prepare_fp8_gather
from ..fp8.swap import resolve_backend, swap_to_fp8
from ..step.grad_sync import _FSDP_RECIPE_ATTR, GradSync, SyncKind, _check_fsdp_recipe
from ..recipe import Recipe, Rounding, get_recipe

__all__ = ["fsdp_policy", "shard_model", "wrap_ddp", "COMM_DTYPES"]

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
                comm_dtype: str | None = None, units: tuple[type[nn.Module], ...] | None = None,
                fp8_all_gather: bool | None = None,
                fp8_filter: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Apply FSDP2's ``fully_shard`` to ``model`` with the recipe's policy; returns ``model``.

    Each module the recipe keeps fp32 (norms, for pure recipes) becomes its own FSDP unit with fp32
    gathers; each module of a type in ``units`` (default: the root's direct children with parameters)
    becomes a unit gathered in the param dtype; the root gathers whatever is left. Build the optimizer
    and ``MixedPrecision`` afterwards, from the sharded parameters. ``mesh`` defaults to a 1-D mesh
    over all ranks on the current device type.

    fp8 recipes: the eligible linears become ``Fp8Linear`` here, before sharding (``fp8_filter`` as
    ``MixedPrecision`` takes it; the engine then finds them swapped). Under per-tensor scaling
    (current or delayed) each one's weight shard is cast to e4m3 before FSDP2's all-gather (1 byte
    per parameter on the wire; ``mixprec.fp8.fsdp_weight``), with the whole weight's scale from one
    all_reduce per step for all layers. ``fp8_all_gather``: None (default) does it wherever it can
    and gathers the rest in the parameter dtype (the fp8 report names each layer's way and why); True
    makes any layer that cannot (blocked scalings, HF Conv1D, uneven shards) a ValueError naming it;
    False turns it off.
    """
    from torch.distributed.fsdp import fully_shard

    recipe = get_recipe(recipe)
    if recipe.rounding is not Rounding.NEAREST:      # bf16-sr, bf16-kahan: refused, with the reason
        _check_fsdp_recipe(model, recipe)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        if not dist.is_initialized():
            raise ValueError("shard_model needs torch.distributed initialized: call "
                             "dist.init_process_group(...) first (torchrun sets the environment)")
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    scales = _prepare_fp8(model, recipe, mesh, fp8_all_gather, fp8_filter)
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
    if scales is not None:
        scales.attach(mesh.get_group())
    setattr(model, _FSDP_RECIPE_ATTR, str(recipe))
    return model


def _prepare_fp8(model: nn.Module, recipe: Recipe, mesh: Any, want: bool | None,
                 fp8_filter: Callable[[str, nn.Module], bool] | None) -> Fp8GatherScales | None:
    """Swap the fp8 recipe's linears before sharding; wrap their weights for the e4m3 all-gather."""
    if recipe.fp8 is None:
        if want:
            raise ValueError(f"fp8_all_gather=True needs an fp8 recipe; {recipe.label!r} has no fp8 layers")
        if fp8_filter is not None:
            raise ValueError(f"fp8_filter was given but recipe {recipe.label!r} has no fp8")
        return None
    already = [n for n, m in model.named_modules() if hasattr(m, "fp8_config")]
    if already:
        raise ValueError(f"the model already has fp8 layers ({', '.join(already[:3])}): was MixedPrecision "
                         "built on it before shard_model? Under FSDP2 the order is shard_model(model, recipe) "
                         "first, then the optimizer and MixedPrecision on the sharded parameters")
    if mesh.ndim != 1:
        raise ValueError("shard_model takes a 1-D mesh (FSDP2); HSDP (2-D meshes) is not supported yet")
    backend, note = resolve_backend(recipe.fp8, next(model.parameters()).device)
    keeps = (lambda m: keeps_fp32(m, recipe)) if recipe.param.is_low else None
    swap_to_fp8(model, recipe.fp8, backend=backend, note=note, filter=fp8_filter, keeps_fp32=keeps)
    return prepare_fp8_gather(model, mesh.size(), want)


class _DdpEngine(Protocol):
    """What ``wrap_ddp`` reads of a ``MixedPrecision`` (typed here so this layer need not import it)."""

    model: nn.Module
    master: Any
    device: torch.device
    grad_sync: GradSync

    def install_grad_sync(self, sync: GradSync) -> None: ...


def wrap_ddp(engine: _DdpEngine, *, comm_dtype: str | None = None, process_group: Any = None,
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

    if "fp8_all_gather" in ddp_kwargs:
        raise ValueError("fp8_all_gather: DDP replicates the weights, so there is no all-gather to run in "
                         "fp8 (each rank casts its own whole weight, as on one process). The e4m3 all-gather "
                         "is FSDP2's: shard_model(model, recipe) before building MixedPrecision")
    if not dist.is_initialized():
        raise ValueError("wrap_ddp needs torch.distributed initialized: call dist.init_process_group(...) "
                         "first (torchrun sets the environment)")
    if engine.grad_sync.kind is SyncKind.SHARDED or isinstance(engine.model, DDP):
        raise ValueError("wrap_ddp takes an engine built on the plain model; this one's model is "
                         f"{'sharded by FSDP2' if engine.grad_sync.fsdp else 'already wrapped in DDP'}")
    dtype = _comm_dtype(comm_dtype)
    group = process_group if process_group is not None else dist.group.WORLD
    model = DDP(engine.model, process_group=group, **ddp_kwargs)
    if engine.master is not None and engine.master.keep:
        src = dist.get_global_rank(group, 0) if group not in (None, dist.group.WORLD) else 0
        with torch.no_grad():
            for m in engine.master.masters:
                dist.broadcast(m.data, src=src, group=group)
        engine.master.mark_synced()     # DDP's broadcast wrote the weights, this one their masters: in step
    if dtype in (torch.float16, torch.bfloat16):
        model.register_comm_hook(group, _compress_hook(dtype, engine.device))
    engine.install_grad_sync(GradSync(SyncKind.REPLICATED, group))
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

"""fp8 all-gather under FSDP2: an fp8 layer's weight shard is cast to e4m3 *before* the all-gather.

FSDP2 (``fully_shard``) keeps each weight sharded along dim 0 and all-gathers it before the layer
runs. For a per-tensor (current or delayed scaling) ``Fp8Linear`` the layer would cast the gathered weight
to e4m3 anyway, so the cast can move in front of the collective: the wire then carries 1 byte per
weight element instead of 4 (fp32) or 2 (bf16), and the gathered fp8 bytes go straight into the fp8
GEMM. Two tensor subclasses plug into FSDP2's own extension points:

- ``Fp8ShardWeight`` wraps the weight *before* ``fully_shard`` (``mixprec.distributed.shard_model``
  does it), so that FSDP's sharded local tensor is one too. Every op unwraps to the fp32 data (the
  optimizer, the gradient norm, checkpoints see the plain weight); the ops FSDP uses to chunk, pad
  and view the shard keep the wrapper. FSDP calls ``fsdp_pre_all_gather`` on the shard: it returns
  the shard cast to e4m3 with the *global* scale, and that scale as metadata.
- ``Fp8GatheredWeight`` is what ``fsdp_post_all_gather`` builds from the gathered bytes: the whole
  weight as e4m3 values plus the scale, claiming the parameter's dtype. ``Fp8Linear`` reads its
  ``fp8_weight()`` and skips its own weight cast; the weight gradient it returns is a plain tensor of
  that dtype, which FSDP reduce-scatters in its usual dtype.

The scale is the one the unsharded weight would get, ``448 / max|W|``: the max of the shards' amaxes
(a max is exact in any order, so the fp8 bytes equal those of casting the whole weight). All fp8
weights' shard amaxes travel in ONE all_reduce (MAX) per step (``Fp8GatherScales.refresh``), run by
the first all-gather that finds its weight changed since the last refresh (the parameter's version
counter moved: an optimizer step, a checkpoint load). The backward's re-gather finds nothing changed
and reuses the scales; a skipped step changes no weight and runs no all_reduce (under delayed scaling
the amax histories change in every backward, so it runs every step). A NaN or inf shard amax is sent
as +inf, so every rank gets the same non-finite amax and, as on one process, the scale 1.

    scale(W) = current_scale(max over ranks r of max|W_r|)        one all_reduce for all layers
    q_r = e4m3(W_r * scale)                                        on each rank, before the gather
    gather(q_r) == e4m3(W * scale)                                 bit for bit the 1-process cast
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ..formats import FP8_E4M3
from ..recipe.fp8 import Fp8Config
from .linear import Fp8Linear
from .scaling import cast_to_fp8, current_scale, delayed_scale

__all__ = ["Fp8ShardWeight", "Fp8GatheredWeight", "Fp8GatherScales", "gather_scales_of", "fp8_in_place",
           "unsharded_class"]

_ATTR = "_mixprec_fp8_gather"     # on the root module: its Fp8GatherScales

# The ops FSDP2 applies to a parameter while sharding and padding it (chunk -> split, new_zeros, slice,
# copy_, view, as_strided, moving it): their outputs stay wrapped, so FSDP's local shard is one.
# Every other op (the optimizer's, the gradient norm's, a checkpoint's) sees and returns plain tensors.
_aten = torch.ops.aten
_KEEP = {_aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
         _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten._pin_memory.default,
         _aten.split.Tensor, _aten.clone.default, _aten.detach.default, _aten.alias.default}


class Fp8GatherScales:
    """The scales of every fp8-gathered weight of one model, refreshed together by one all_reduce.

    ``weights``: the sharded parameters (DTensors after ``fully_shard``; their local tensors are
    ``Fp8ShardWeight``), ``names`` their layers, ``group`` the FSDP process group, ``config`` the
    recipe's per-tensor scaling (current or delayed). ``refreshes`` counts the all_reduces run.

    Delayed scaling: the scale is ``delayed_scale`` of the layer's weight amax history (entered by
    the layer's backward, with the global amax) and this step's global amax, as on one process; a
    history that changed (a backward, a loaded checkpoint) makes the scales stale like a weight does.
    """

    def __init__(self, names: list[str], config: Fp8Config) -> None:
        self.names, self.config = names, config
        self.layers: list[nn.Module] = []              # the fp8 layers, in ``names`` order
        self.weights: list[torch.Tensor] = []
        self.group: Any = None
        self.amax: torch.Tensor | None = None          # (layers,) global amaxes, fp32
        self.scale: torch.Tensor | None = None         # (layers,) e4m3 scales, fp32
        self._versions: list[tuple[int, ...]] = []
        self.refreshes = 0

    def attach(self, group: Any) -> None:
        """After ``fully_shard``: hold the layers' sharded parameters and the group their ranks form."""
        self.weights, self.group = [m.weight for m in self.layers], group

    def _version(self, index: int) -> tuple[int, ...]:
        # In-place writes bump the version of the tensor they were called on: the optimizer's (through
        # the DTensor) the parameter's, a write to the local shard that one's, below it the data's.
        w = self.weights[index]
        local = w._local_tensor if hasattr(w, "_local_tensor") else w
        history = (self.layers[index].weight_history._version,) if self.config.delayed else ()
        return (w._version, local._version, getattr(local, "_data", local)._version, *history)

    def _shards(self) -> list[torch.Tensor]:
        out = []
        for w in self.weights:
            local = w._local_tensor if hasattr(w, "_local_tensor") else w
            out.append(local._data if isinstance(local, Fp8ShardWeight) else local)
        return out

    def stale(self, index: int) -> bool:
        """Whether weight ``index`` changed in place since the last refresh (or none ran yet)."""
        return self.scale is None or self._version(index) != self._versions[index]

    @torch.no_grad()
    def refresh(self) -> None:
        """Every layer's global amax and scale from one all_reduce (MAX) of the stacked shard amaxes.

        Collective: every rank of ``group`` must call it at the same point (FSDP's all-gathers are in
        the same order on every rank, and the weights change in lockstep, so they do).
        """
        shards = self._shards()
        device = shards[0].device
        # max|W_r| per shard in fp32 (exact); an empty shard (fewer rows than ranks) contributes 0.
        local = torch.stack([torch.linalg.vector_norm(s, float("inf")).to(torch.float32) if s.numel()
                             else torch.zeros((), device=device) for s in shards])
        # NaN -> +inf before MAX: a reduction's NaN handling is the backend's; +inf reaches every rank.
        local = torch.where(torch.isnan(local), torch.full_like(local, float("inf")), local)
        if self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        self.amax, cfg = local, self.config
        if cfg.delayed:
            self.scale = torch.stack([delayed_scale(m.weight_history, local[i], m.weight_scale, FP8_E4M3,
                                                    algo=cfg.amax, margin=cfg.margin, pow2=cfg.pow2)
                                      for i, m in enumerate(self.layers)])
        else:
            self.scale = current_scale(local, FP8_E4M3, margin=cfg.margin, pow2=cfg.pow2)
        self._versions = [self._version(i) for i in range(len(self.weights))]
        self.refreshes += 1

    def scale_of(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, amax)`` of weight ``index``, refreshing all of them first if it changed.

        Checking this one weight keeps each gather O(1): the weights change together (an optimizer
        step), so the step's first gather refreshes all; a weight changed alone refreshes at its own.
        """
        if self.stale(index):
            self.refresh()
        assert self.scale is not None and self.amax is not None
        return self.scale[index], self.amax[index]


class Fp8ShardWeight(torch.Tensor):
    """A high-precision weight (or FSDP's shard of it) whose all-gather runs in e4m3.

    ``_data`` is the plain tensor; ``_scales``/``_index`` name the shared ``Fp8GatherScales`` entry.
    It claims ``_data``'s dtype, shape and strides, so to everything but FSDP's all-gather it is that
    tensor.
    """

    _data: torch.Tensor
    _scales: Fp8GatherScales
    _index: int

    @staticmethod
    def __new__(cls, data: torch.Tensor, scales: Fp8GatherScales, index: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, scales: Fp8GatherScales, index: int) -> None:
        self._data, self._scales, self._index = data, scales, index

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        meta: tuple[Fp8GatherScales, int] | None = None

        def unwrap(t: Fp8ShardWeight) -> torch.Tensor:
            nonlocal meta
            meta = meta or (t._scales, t._index)
            return t._data

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP or meta is None:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, *meta), out)

    def __tensor_flatten__(self):
        return ["_data"], (self._scales, self._index)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8ShardWeight(inner["_data"], *ctx)

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, torch.distributed.checkpoint) as the plain tensor it stands for: a
        # checkpoint holds the weight, not this model's scale bookkeeping.
        return self._data.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"Fp8ShardWeight({self._scales.names[self._index]}, {self._data!r})"

    # FSDP2's all-gather extension (torch.distributed.fsdp._fully_shard._fsdp_param).
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The shard as e4m3 bytes (what goes on the wire) and the global scale (metadata, not sent)."""
        scale, amax = self._scales.scale_of(self._index)
        # Sent as the raw bytes (uint8): gloo has no float8 type, and a byte is a byte on any backend.
        return (cast_to_fp8(self._data, scale, FP8_E4M3).view(torch.uint8),), (scale, amax)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered e4m3 weight; on later gathers FSDP refills the same storage and passes ``out``."""
        (data,), (scale, amax) = outputs, metadata
        data = data.view(FP8_E4M3.torch_dtype)          # the same storage, read as e4m3 again
        if out is not None:
            out._scale, out._amax = scale, amax
            return None
        return Fp8GatheredWeight(data, scale, amax, param_dtype), (data,)


class Fp8GatheredWeight(torch.Tensor):
    """A whole weight held as e4m3 values ``_data`` (``W * scale``) and its fp32 ``_scale``.

    It claims ``dtype`` (the parameter's), so autograd gives it a plain gradient of that dtype.
    ``Fp8Linear`` takes ``fp8_weight()`` directly; any other op sees the dequantized weight
    ``_data / _scale`` (never a silent fp32 gather: the values are the fp8 ones).
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _amax: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, layout=data.layout, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale, self._amax = data, scale, amax

    __torch_function__ = torch._C._disabled_torch_function_impl

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(e4m3 values W * scale, scale, global amax)``: the weight cast the layer would make."""
        return self._data, self._scale, self._amax

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            (w,) = args
            return cls(w._data, w._scale, w._amax, w.dtype)
        if func is _aten.as_strided.default and args[1] == list(args[0].shape):
            w = args[0]        # FSDP's as_strided to the parameter's own shape: the same weight
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w._amax, w.dtype)

        def dequantize(w: Fp8GatheredWeight) -> torch.Tensor:
            return (w._data.to(torch.float32) / w._scale).to(w.dtype)

        args, kwargs = pytree.tree_map_only(cls, dequantize, (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], inner["_amax"], dtype)

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(e4m3 {tuple(self.shape)}, scale={self._scale}, dtype={self.dtype})"


def gather_scales_of(model: nn.Module) -> Fp8GatherScales | None:
    """The model's ``Fp8GatherScales`` (set by ``shard_model`` with fp8 all-gather), or None."""
    return getattr(model, _ATTR, None)


def unsharded_class(module: nn.Module) -> type:
    """``module``'s class, or for one ``fully_shard`` wrapped, the class FSDP2 derived from."""
    bases = type(module).__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1]
    return type(module)


_FSDP_FP8: dict[type, type] = {}


def fp8_in_place(module: nn.Module, config: Fp8Config, backend: str) -> None:
    """Make the ``nn.Linear`` ``module`` an ``Fp8Linear`` without replacing the object (FSDP2 holds it):
    its class becomes Fp8Linear, or FSDP2's wrapper class over Fp8Linear, and the fp8 state is added."""
    cls = Fp8Linear
    if type(module) is not nn.Linear:         # FSDPLinear: keep FSDPModule first in the MRO, as FSDP2 does
        fsdp_base = type(module).__bases__[0]
        if fsdp_base not in _FSDP_FP8:
            _FSDP_FP8[fsdp_base] = type(f"{fsdp_base.__name__[:-len('Module')]}{Fp8Linear.__name__}",
                                        (fsdp_base, Fp8Linear), {"__deepcopy__": type(module).__deepcopy__})
        cls = _FSDP_FP8[fsdp_base]
    module.__class__ = cls
    module._setup_fp8(config, backend, module.weight.device)


def fp8_gather_blocker(layer: nn.Module, world: int) -> str | None:
    """Why ``layer``'s weight cannot be all-gathered in e4m3 over ``world`` ranks, or None if it can."""
    cfg = getattr(layer, "fp8_config", None)
    if cfg is None:
        return "not an fp8 layer"
    if cfg.blocked:
        return (f"fp8={cfg.scaling.value} scales blocks of each GEMM operand; the e4m3 all-gather takes "
                "per-tensor scaling (fp8=current or delayed)")
    if unsharded_class(layer) is not Fp8Linear:
        return f"a {unsharded_class(layer).__name__}: the e4m3 all-gather covers Fp8Linear (weight (out, in))"
    if layer.out_features % world:
        return (f"its {layer.out_features} weight rows do not split evenly over {world} ranks "
                "(FSDP2 would pad the last shard)")
    return None


def prepare_fp8_gather(model: nn.Module, world: int, want: bool | None) -> Fp8GatherScales | None:
    """Wrap each fp8 layer's weight in ``Fp8ShardWeight`` before ``fully_shard``; the shared scales.

    ``want`` True: every fp8 layer must gather in e4m3 (ValueError naming each one that cannot, and
    why); None: those that can do, the others gather in the parameter dtype and cast after the gather
    (each layer's ``fp8_gather_note`` says which and why; the engine's fp8 report shows it); False:
    none do. Returns None when no weight was wrapped. Call ``attach`` on the result after sharding.
    """
    layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "fp8_config")]
    blockers = {n: fp8_gather_blocker(m, world) for n, m in layers}
    if want:
        by_reason: dict[str, list[str]] = {}
        for n, why in blockers.items():
            if why:
                by_reason.setdefault(why, []).append(n or "<the model>")
        if by_reason:
            shown = "; ".join(f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}: {why}"
                              for why, names in by_reason.items())
            raise ValueError(f"fp8_all_gather=True, but {sum(map(len, by_reason.values()))} fp8 layer(s) "
                             f"cannot gather in e4m3: {shown}" +
                             ". Leave fp8_all_gather unset (those layers then gather in the parameter "
                             "dtype and cast after the gather) or change the recipe/layer")
    chosen = [(n, m) for n, m in layers if want is not False and blockers[n] is None]
    for n, m in layers:
        m.fp8_gather_note = ("weight all-gathered in e4m3 (1 B/param)" if blockers[n] is None and want is not False
                             else "weight all-gathered unscaled, cast after the gather: "
                             + ("fp8_all_gather=False" if want is False else str(blockers[n])))
    if not chosen:
        return None
    scales = Fp8GatherScales([n for n, _ in chosen], chosen[0][1].fp8_config)   # one recipe, one config
    for i, (_, m) in enumerate(chosen):
        w = m.weight
        m.weight = nn.Parameter(Fp8ShardWeight(w.detach(), scales, i), requires_grad=w.requires_grad)
    scales.layers = [m for _, m in chosen]
    setattr(model, _ATTR, scales)
    return scales

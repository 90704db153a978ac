"""Preparing a model for a recipe: cast weights, set per-module precision, cast inputs in and outputs out.

Pure recipes (fp16/bf16 weights) cast every parameter to the low dtype except in modules the recipe
keeps fp32 (normalisations by default: their mean and variance reduce over many values), and each
floating buffer only where ``buffers.cast_buffers`` finds it safe (running statistics, and tables a
cast would round, such as rotary frequencies, stay fp32). Softmax and the loss are computed in fp32
(a sum over many terms loses small ones in 16 bits) under every low-compute recipe: a loss the model
returns (a floating 0-d output) is cast to fp32 (an fp16 loss times the loss scale would overflow);
under a pure recipe, logits are cast to fp32 only where autocast's op lists would leave the loss's
log_softmax in 16 bits (CPU) and the model did not compute its loss itself. An autocast recipe hands
logits on as torch.autocast made them: its ``F.cross_entropy`` is autocast's, in fp32. On CUDA autocast runs log_softmax in fp32 straight from 16-bit logits, so the logits stay
16-bit and no fp32 copy of them is kept (compute the loss inside ``mp.autocast()``).

Per-module precision (``Recipe.modules``, and ``fp32_modules`` in pure recipes) makes *regions*: a
module whose precision differs from its parent's, together with its children. Its forward runs
inside ``torch.autocast(enabled=<16-bit region>, dtype=<region dtype>)``; its floating inputs are cast
to the region's dtype where the ops inside need it (pure recipes always: the region's weights are in
that dtype; autocast recipes only into fp32 regions, since autocast casts for 16-bit ones); its outputs
are handed back in the dtype its inputs came in, unless the region around it runs autocast (which casts
them as each op needs). So ``lm_head:fp32`` in a bf16 recipe, pure or not, yields fp32 logits, and
``blocks.*.attn:bf16`` in an fp32 recipe hands fp32 back to the fp32 residual stream. The
``fp32_modules`` norms of pure recipes always hand the low dtype back, so activations stay 16-bit.

Regions wrap the module's ``forward`` so that ``torch.autocast`` is entered and exited inside one call
(torch.compile traces that; it cannot trace a context entered in a pre-hook and left in a post-hook).
The model's own input and output casts wrap its ``forward`` the same way, so ``torch.compile(model)``
traces them into the model's graph (as hooks each would be a graph of its own). Wrappers are
module-level functions held by ``functools.partial``, so a prepared model still pickles.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import inspect
from typing import Any

import torch
from torch import nn

from .buffers import cast_buffers
from ..recipe import DEFAULT_FP32_MODULES, Precision, Recipe

__all__ = ["keeps_fp32", "module_precisions", "check_module_patterns", "low_precision_params",
           "cast_model", "cast_floating"]


def keeps_fp32(module: nn.Module, recipe: Recipe) -> bool:
    """True if the recipe keeps this module's weights and compute in fp32 (class-name substring match)."""
    name = type(module).__name__
    return any(pattern in name for pattern in recipe.fp32_modules)


def _module_rule(name: str, module: nn.Module, recipe: Recipe) -> Precision | None:
    """The precision the last matching ``modules`` pair gives this module, or None."""
    cls = type(module).__name__
    for pattern, precision in reversed(recipe.modules):
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(cls, pattern):
            return precision
    return None


def _own_precision(name: str, module: nn.Module, recipe: Recipe) -> Precision | None:
    """The precision a rule gives this module itself: its ``modules`` rule, else fp32 for an
    ``fp32_modules`` class in a pure recipe, else None (it inherits its parent's)."""
    rule = _module_rule(name, module, recipe)
    if rule is None and recipe.param.is_low and keeps_fp32(module, recipe):
        return Precision.FP32
    return rule


def _base_precision(recipe: Recipe) -> Precision:
    # TF32 is fp32 storage with a global matmul switch; a module cannot opt out of it, so regions
    # compare it as fp32.
    return Precision.FP32 if recipe.compute is Precision.TF32 else recipe.compute


def module_precisions(model: nn.Module, recipe: Recipe) -> dict[str, Precision]:
    """Each module's compute precision by qualified name (``""`` is the model): its own rule, else its
    parent's, else the recipe's compute precision (tf32 counts as fp32).

        >>> from mixprec import parse_recipe
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> module_precisions(net, parse_recipe("bf16-pure"))
        {'': <Precision.BF16: 'bf16'>, '0': <Precision.BF16: 'bf16'>, '1': <Precision.FP32: 'fp32'>}
    """
    out: dict[str, Precision] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        parent = out.get(name.rpartition(".")[0], _base_precision(recipe)) if name else _base_precision(recipe)
        out[name] = _own_precision(name, module, recipe) or parent
    return out


def check_module_patterns(model: nn.Module, recipe: Recipe) -> None:
    """ValueError for a ``modules`` pattern, or an ``fp32_modules`` class name a pure recipe was given,
    that matches no module of ``model``, naming close matches (a typo would leave norms 16-bit)."""
    names = {n: type(m).__name__ for n, m in model.named_modules() if n}
    if recipe.param.is_low and recipe.fp32_modules != DEFAULT_FP32_MODULES:
        classes = sorted(set(names.values()) | {type(model).__name__})
        for word in recipe.fp32_modules:
            if not any(word in c for c in classes):
                close = difflib.get_close_matches(word, classes, n=4, cutoff=0.5)
                raise ValueError(
                    f"fp32_modules={word} matches no module class of {type(model).__name__} (a substring of "
                    f"a class name keeps that module fp32); "
                    + (f"did you mean {', '.join(close)}?" if close else f"its classes: {', '.join(classes[:8])}"))
    for pattern, precision in recipe.modules:
        if any(fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(c, pattern) for n, c in names.items()):
            continue
        words = sorted(set(names) | set(names.values()))
        close = difflib.get_close_matches(pattern, words, n=4, cutoff=0.5)
        hint = (f"did you mean {', '.join(close)}?" if close else
                f"its modules include {', '.join(list(names)[:6])}")
        raise ValueError(f"modules={pattern}:{precision.value} matches no module of "
                         f"{type(model).__name__}; {hint} (patterns are fnmatch globs over qualified "
                         "names, e.g. blocks.*.attn, or class names, e.g. LayerNorm)")


def low_precision_params(model: nn.Module, recipe: Recipe) -> list[nn.Parameter]:
    """The floating parameters a pure recipe casts to its param dtype, each once, in model order."""
    if not recipe.param.is_low:
        return []
    precisions = module_precisions(model, recipe)
    named = list(model.named_modules(remove_duplicate=False))
    kept = {id(p) for n, m in named if precisions[n] is Precision.FP32 for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    params = []
    for name, module in named:
        if precisions[name] is Precision.FP32:
            continue
        for p in module.parameters(recurse=False):
            # A parameter shared with a kept module stays fp32 (tying an fp32 norm weight wins).
            if p.is_floating_point() and id(p) not in kept and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def cast_model(model: nn.Module, recipe: Recipe, device_type: str | None = None, *,
               cast_params: bool = True) -> list[Any]:
    """Cast the model in place for ``recipe`` and install its casting hooks; returns handles whose
    ``remove()`` undoes the hooks and forward wrappers.

    Parameters keep their identity (``p.data`` is replaced), so references held elsewhere stay valid.
    ``device_type`` is the autocast device of the regions (default: that of the first parameter).
    ``cast_params=False`` leaves the parameters alone (FSDP2 casts them as it gathers them) and casts
    only the floating buffers and installs the hooks. Raises ValueError if a ``modules`` pattern
    matches no module.
    """
    check_module_patterns(model, recipe)
    if device_type is None:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
    precisions = module_precisions(model, recipe)
    handles = []
    for name, module in model.named_modules():
        parent = precisions[name.rpartition(".")[0]] if name else _base_precision(recipe)
        rule = _module_rule(name, module, recipe)
        # In pure recipes a module a rule puts in 16 bits gets its inputs cast even where its parent
        # runs 16 bits too: an fp32 region before it may hand it fp32, which native norm kernels with
        # 16-bit weights reject.
        if precisions[name] is not parent or (recipe.param.is_low and rule is not None and rule.is_low):
            # fp32_modules norms in pure recipes always hand the low dtype back (cheap activations,
            # as before module rules existed); a modules= rule hands back only where nothing else
            # would cast (see _leave_region_hook), so lm_head:fp32 yields fp32 logits.
            always_restore = recipe.param.is_low and rule is None
            handles += _install_region(module, precisions[name], recipe, device_type, always_restore)
    if recipe.param.is_low:
        dtype = recipe.param.dtype
        low = {id(p) for p in low_precision_params(model, recipe)}
        for name, module in model.named_modules():
            if precisions[name] is Precision.FP32:
                continue
            for p in module.parameters(recurse=False):
                if cast_params and id(p) in low:
                    p.data = p.data.to(dtype)
        # Buffers are not weights (no master copy keeps them): each is decided on its own (casting/buffers.py).
        kept = frozenset(n for n, prec in precisions.items() if prec is Precision.FP32)
        cast_buffers(model, dtype, skip=kept)
    if recipe.param.is_low or recipe.compute.is_low:
        # Inputs come from fp32 data pipelines; a pure recipe's first layer has low-precision weights.
        # Logits: an autocast recipe hands the caller what torch.autocast gives, so its loss is
        # torch.amp's bit for bit (F.cross_entropy is on autocast's fp32 list everywhere); only a pure
        # recipe's 16-bit logits are lifted where autocast would run log_softmax in 16 bits.
        low = recipe.compute.is_low
        cast_tensors = low and recipe.param.is_low and not autocast_softmax_is_fp32(device_type, recipe.compute.dtype)
        edges = _Edges(recipe.param.dtype if recipe.param.is_low else None, torch.float32 if low else None,
                       cast_tensors)
        handles.append(_install_edges(model, edges))
    return handles


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in a nest of tuples, lists and dicts; leave integer tensors alone.

    Written with plain loops and comprehensions (no generator handed to a constructor) so that
    torch.compile traces it without a graph break, dict subclasses (Hugging Face's ``ModelOutput``)
    included.
    """
    return _cast_nest(value, dtype, scalars_only=False)


def _cast_nest(value: Any, dtype: torch.dtype, scalars_only: bool) -> Any:
    if isinstance(value, torch.Tensor):
        # The dtype's and the tensor's attributes, not Tensor.is_floating_point() and .dim(): this runs
        # on the model's inputs and outputs at every step, and each method is one more call.
        have = value.dtype
        wanted = have != dtype and have.is_floating_point and (not scalars_only or value.ndim == 0)
        return value.to(dtype) if wanted else value
    if isinstance(value, (list, tuple)):
        cast = [_cast_nest(v, dtype, scalars_only) for v in value]
        if type(value) is tuple:     # the positional arguments themselves: no namedtuple to look for
            return tuple(cast)
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return _rebuild_dict(value, {k: _cast_nest(v, dtype, scalars_only) for k, v in value.items()})
    return value


def _holds_scalar(value: Any) -> bool:
    """True if a floating 0-d tensor (a loss the model computed itself) is in the nest."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.dim() == 0
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            if _holds_scalar(v):
                return True
    return False


def _rebuild_dict(like: dict, items: dict) -> dict:
    """A dict of ``like``'s type holding ``items``: plain dicts as is, subclasses from keywords where the
    keys are names (dataclass-like outputs such as ``ModelOutput`` take fields as keywords)."""
    if type(like) is dict:
        return items
    if all(isinstance(k, str) for k in items):
        return type(like)(**items)
    return type(like)(list(items.items()))


def _first_floating_dtype(value: Any) -> torch.dtype | None:
    """The dtype of the first floating tensor in a nest of tuples, lists and dicts, or None."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_floating_dtype(v)
            if found is not None:
                return found
    return None


@dataclasses.dataclass(frozen=True)
class _Edges:
    """The casts at the model's own edges: floating inputs in, outputs out (``_cast_output``)."""

    cast_in: torch.dtype | None     # a pure recipe's param dtype; None: inputs pass as they are
    cast_out: torch.dtype | None    # fp32 under a 16-bit compute recipe; None: outputs pass as they are
    cast_tensors: bool              # logits too, not only a loss the model computed


def _install_edges(model: nn.Module, edges: _Edges) -> _RegionHandle:
    """Wrap the model's ``forward`` (as regions do) with its edge casts.

    Not forward hooks: ``torch.compile(model)`` runs a module's hooks outside the frame it compiles
    and compiles each hook as a graph of its own (a one-node graph per cast, each with its own guards
    and call); inside ``forward`` the casts are traced into the model's graph. The wrapper keeps the
    forward's signature, which libraries read (the HF Trainer picks dataset columns by it).
    """
    inner = model.__dict__.get("forward")
    wrapper = functools.partial(_edges_forward, model, inner, edges)
    try:
        wrapper.__signature__ = inspect.signature(model.forward)
    except (TypeError, ValueError):      # a builtin or C forward without one: nothing to keep
        pass
    model.forward = wrapper
    return _RegionHandle(model, inner)


def _edges_forward(module: nn.Module, inner: Any, edges: _Edges, *args: Any, **kwargs: Any) -> Any:
    if edges.cast_in is not None:
        args = cast_floating(args, edges.cast_in)
        if kwargs:     # most forwards take their inputs by position: no empty dict walked per step
            kwargs = cast_floating(kwargs, edges.cast_in)
    out = inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)
    return _cast_output(out, edges.cast_out, edges.cast_tensors) if edges.cast_out is not None else out


@dataclasses.dataclass(frozen=True)
class _Region:
    """How a region's forward runs: its precision, autocast device, input cast and output rule."""

    precision: Precision
    device_type: str
    cast_to: torch.dtype | None     # cast floating inputs to this dtype first (None: leave them)
    always_restore: bool            # hand the output back in the incoming dtype even under autocast


class _RegionHandle:
    """``remove()`` puts the module's own forward back (the role a hook's RemovableHandle plays)."""

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.module, self.inner = module, inner

    def remove(self) -> None:
        if self.inner is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.inner


def _install_region(module: nn.Module, precision: Precision, recipe: Recipe, device_type: str,
                    always_restore: bool) -> list[_RegionHandle]:
    """Run ``module`` (and its children) in ``precision``; see the module docstring.

    The module's ``forward`` is wrapped (an instance attribute, a ``functools.partial`` of a
    module-level function: it pickles) so that ``torch.autocast`` is entered and exited inside one
    call. A pre-hook that enters it and a post-hook that exits it is what torch.compile cannot trace.
    """
    cast_to = precision.dtype if recipe.param.is_low or precision is Precision.FP32 else None
    region = _Region(precision, device_type, cast_to, always_restore)
    inner = module.__dict__.get("forward")      # a forward the user (or a library) set already
    module.forward = functools.partial(_region_forward, module, inner, region)
    return [_RegionHandle(module, inner)]


def _region_forward(module: nn.Module, inner: Any, region: _Region, *args: Any, **kwargs: Any) -> Any:
    incoming = _first_floating_dtype([args, kwargs])
    outer_autocast = torch.is_autocast_enabled(region.device_type)
    if region.cast_to is not None:
        args, kwargs = cast_floating(args, region.cast_to), cast_floating(kwargs, region.cast_to)
    low = region.precision.is_low
    # The with-block restores autocast's state even when the forward raises.
    with torch.autocast(region.device_type, dtype=region.precision.dtype if low else None, enabled=low):
        out = inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)
    # Hand the output back in the incoming dtype where the surroundings need it: outside autocast
    # nothing else would cast it for the next layer's weights. Under autocast leave it be.
    if incoming is not None and (region.always_restore or not outer_autocast):
        return cast_floating(out, incoming)
    return out


@functools.lru_cache(maxsize=None)
def autocast_softmax_is_fp32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype)`` runs ``log_softmax`` (cross-entropy's first op)
    in fp32 on its own: CUDA's op lists do (reading 16 bits, writing fp32, no fp32 copy of the input);
    CPU's leave it in 16 bits. Asked once per device and dtype with a 2-element tensor (no host sync)."""
    try:
        with torch.autocast(device_type, dtype=dtype):
            return torch.log_softmax(torch.zeros(2, dtype=dtype, device=device_type), 0).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def _cast_output(output: Any, dtype: torch.dtype, cast_tensors: bool) -> Any:
    """The model's floating outputs for the loss: scalars (a loss the model computed) always in fp32;
    other tensors (logits) in fp32 only where ``cast_tensors`` (autocast would run the loss's softmax
    in 16 bits) and the model did not compute its loss itself.

    Copying the logits to fp32 when the loss does not need it doubles them (4 bytes per value instead
    of 2), and a caller that keeps the output alive through backward (Hugging Face models do) keeps
    the copy: with a 128k vocabulary that is gigabytes.
    """
    scalars_only = not cast_tensors or _holds_scalar(output)
    return _cast_nest(output, dtype, scalars_only)

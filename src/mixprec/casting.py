"""Preparing a model for a recipe: cast weights, set per-module precision, cast inputs in and outputs out.

Pure recipes (fp16/bf16 weights) cast every parameter to the low dtype except in modules the recipe
keeps fp32 (normalisations by default: their mean and variance reduce over many values), and each
floating buffer only where ``buffers.cast_buffers`` finds it safe (running statistics, and tables a
cast would round, such as rotary frequencies, stay fp32). Every low-compute recipe casts the model's
floating outputs to fp32, so softmax and the loss are computed in fp32 (seed 001) even where
autocast's op lists leave them in 16 bits (CPU autocast keeps log_softmax in fp16).

Per-module precision (``Recipe.modules``, and ``fp32_modules`` in pure recipes) makes *regions*: a
module whose precision differs from its parent's, together with its children. Its forward runs
inside ``torch.autocast(enabled=<16-bit region>, dtype=<region dtype>)``; its floating inputs are cast
to the region's dtype where the ops inside need it (pure recipes always: the region's weights are in
that dtype; autocast recipes only into fp32 regions, since autocast casts for 16-bit ones); its outputs
are handed back in the dtype its inputs came in, unless the region around it runs autocast (which casts
them as each op needs). So ``lm_head:fp32`` in a bf16 recipe, pure or not, yields fp32 logits, and
``blocks.*.attn:bf16`` in an fp32 recipe hands fp32 back to the fp32 residual stream. The
``fp32_modules`` norms of pure recipes always hand the low dtype back, so activations stay 16-bit.

Hooks are module-level callables held by ``functools.partial``, so a prepared model still pickles.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .buffers import cast_buffers
from .recipe import Precision, Recipe

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
    """ValueError for a ``modules`` pattern that matches no module of ``model``, naming close matches."""
    names = {n: type(m).__name__ for n, m in model.named_modules() if n}
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
               cast_params: bool = True) -> list[torch.utils.hooks.RemovableHandle]:
    """Cast the model in place for ``recipe`` and install its casting hooks; returns the hook handles.

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
        # Buffers are not weights (no master copy keeps them): each is decided on its own (buffers.py).
        kept = frozenset(n for n, prec in precisions.items() if prec is Precision.FP32)
        cast_buffers(model, dtype, skip=kept)
        # Inputs come from fp32 data pipelines; the first layer's weights are low precision.
        handles.append(model.register_forward_pre_hook(
            functools.partial(_cast_inputs_hook, dtype=dtype), with_kwargs=True))
    if recipe.compute.is_low:
        handles.append(model.register_forward_hook(
            functools.partial(_cast_output_hook, dtype=torch.float32)))
    return handles


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in a nest of tuples, lists and dicts; leave integer tensors alone."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        cast = [cast_floating(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return type(value)((k, cast_floating(v, dtype)) for k, v in value.items())
    return value


def _first_floating_dtype(values: Any) -> torch.dtype | None:
    return next((t.dtype for t in _tensors(values) if t.is_floating_point()), None)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _cast_inputs_hook(module: nn.Module, args: tuple, kwargs: dict, *, dtype: torch.dtype):
    return cast_floating(args, dtype), cast_floating(kwargs, dtype)


def _install_region(module: nn.Module, precision: Precision, recipe: Recipe, device_type: str,
                    always_restore: bool) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that run ``module`` (and its children) in ``precision``; see the module docstring."""
    cast_to = precision.dtype if recipe.param.is_low or precision is Precision.FP32 else None
    enter = functools.partial(_enter_region_hook, precision=precision, device_type=device_type,
                              cast_to=cast_to)
    leave = functools.partial(_leave_region_hook, always_restore=always_restore)
    # always_call: the autocast state is restored even when the forward raises.
    return [module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, with_kwargs=True, always_call=True)]


def _enter_region_hook(module: nn.Module, args: tuple, kwargs: dict, *, precision: Precision,
                       device_type: str, cast_to: torch.dtype | None):
    # A stack on the module, so a module that calls itself (or is shared) nests correctly. Kept in
    # __dict__ directly: nn.Module.__setattr__ is slow, and an empty list pickles.
    stack = module.__dict__.setdefault("_mixprec_regions", [])
    incoming = _first_floating_dtype((args, kwargs))
    outer_autocast = torch.is_autocast_enabled(device_type)
    region = torch.autocast(device_type, dtype=precision.dtype if precision.is_low else None,
                            enabled=precision.is_low)
    region.__enter__()
    stack.append((region, incoming, outer_autocast))
    if cast_to is None:
        return None
    return cast_floating(args, cast_to), cast_floating(kwargs, cast_to)


def _leave_region_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any, *, always_restore: bool):
    region, incoming, outer_autocast = module.__dict__["_mixprec_regions"].pop()
    region.__exit__(None, None, None)
    # Hand the output back in the incoming dtype where the surroundings need it: outside autocast
    # nothing else would cast it for the next layer's weights. Under autocast leave it be.
    if incoming is not None and (always_restore or not outer_autocast):
        return cast_floating(output, incoming)
    return None


def _cast_output_hook(module: nn.Module, args: tuple, output: Any, *, dtype: torch.dtype):
    return cast_floating(output, dtype)

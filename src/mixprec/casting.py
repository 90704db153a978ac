"""Preparing a model for a recipe: cast weights, keep norms fp32, cast inputs in and outputs out.

Pure recipes (fp16/bf16 weights) cast every parameter and floating buffer to the low dtype except in
modules the recipe keeps fp32 (normalisations by default: their mean and variance reduce over many
values). Those modules get hooks that cast their inputs up to fp32 and their outputs back down, so the
layers around them keep seeing the low dtype. Every low-compute recipe casts the model's floating
outputs to fp32, so softmax and the loss are computed in fp32 (seed 001) even where autocast's op lists
leave them in 16 bits (CPU autocast keeps log_softmax in fp16).

Hooks are module-level callables held by ``functools.partial``, so a prepared model still pickles.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .recipe import Recipe

__all__ = ["keeps_fp32", "low_precision_params", "cast_model", "cast_floating"]


def keeps_fp32(module: nn.Module, recipe: Recipe) -> bool:
    """True if the recipe keeps this module's weights and compute in fp32 (class-name substring match)."""
    name = type(module).__name__
    return any(pattern in name for pattern in recipe.fp32_modules)


def low_precision_params(model: nn.Module, recipe: Recipe) -> list[nn.Parameter]:
    """The floating parameters a pure recipe casts to its param dtype, each once, in model order."""
    if not recipe.param.is_low:
        return []
    kept = {id(p) for m in model.modules() if keeps_fp32(m, recipe) for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    params = []
    for module in model.modules():
        if keeps_fp32(module, recipe):
            continue
        for p in module.parameters(recurse=False):
            # A parameter shared with a kept module stays fp32 (tying an fp32 norm weight wins).
            if p.is_floating_point() and id(p) not in kept and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def cast_model(model: nn.Module, recipe: Recipe, *,
               cast_params: bool = True) -> list[torch.utils.hooks.RemovableHandle]:
    """Cast the model in place for ``recipe`` and install its casting hooks; returns the hook handles.

    Parameters keep their identity (``p.data`` is replaced), so references held elsewhere stay valid.
    ``cast_params=False`` leaves the parameters alone (FSDP2 casts them as it gathers them) and casts
    only the floating buffers and installs the hooks.
    """
    handles = []
    if recipe.param.is_low:
        dtype = recipe.param.dtype
        low = {id(p) for p in low_precision_params(model, recipe)}
        for module in model.modules():
            if keeps_fp32(module, recipe):
                handles.append(module.register_forward_pre_hook(
                    functools.partial(_cast_inputs_hook, dtype=torch.float32), with_kwargs=True))
                handles.append(module.register_forward_hook(_restore_output_dtype_hook, with_kwargs=True))
                continue
            for p in module.parameters(recurse=False):
                if cast_params and id(p) in low:
                    p.data = p.data.to(dtype)
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(module, name, buf.to(dtype))
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
    # Remember the incoming dtype so a kept-fp32 module can hand its output back in the same dtype.
    module._mixprec_input_dtype = _first_floating_dtype((args, kwargs))  # type: ignore[assignment]
    return cast_floating(args, dtype), cast_floating(kwargs, dtype)


def _restore_output_dtype_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    dtype = getattr(module, "_mixprec_input_dtype", None)
    return cast_floating(output, dtype) if dtype is not None else output


def _cast_output_hook(module: nn.Module, args: tuple, output: Any, *, dtype: torch.dtype):
    return cast_floating(output, dtype)

"""The arguments ``MixedPrecision(...)`` takes, checked before anything is touched: a wrong type or value
is a TypeError/ValueError that names the argument, what it takes and an example, not a traceback from
deep inside the first step (``check_arguments``); then the model and the optimizer against each other,
the recipe and the device (``check_model_and_optimizer``). Only after both does the engine prepare the
model (``step/parts.py``)."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .casting.model import check_module_patterns, low_precision_params
from .devices import supports
from .fp8.swap import check_fp8_patterns
from .guards.usage import check_param_dtypes, foreign_params_message
from .step.grad_sync import GroupChoice

if TYPE_CHECKING:
    from .recipe import Recipe

__all__ = ["check_arguments", "check_model_and_optimizer"]


def check_arguments(model: Any, optimizer: Any, clip_grad_norm: Any, fp8_filter: Any, trace_nonfinite: Any,
                    process_group: Any, seed: Any = 0) -> None:
    """Raise TypeError/ValueError for an argument of the engine that cannot be right."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(trace_nonfinite, bool):    # "no" would be truthy
        raise TypeError(f"trace_nonfinite must be True or False, got {trace_nonfinite!r}")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool)
                                       or not isinstance(clip_grad_norm, numbers.Real)):
        raise TypeError(f"clip_grad_norm must be a positive number (the largest global L2 norm of the "
                        f"unscaled gradients, e.g. 1.0) or None, got {type(clip_grad_norm).__name__} "
                        f"{clip_grad_norm!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm}")
    # Any int seeds the noise (taken modulo 2**64). Checked here, under every recipe: under bf16-sr the
    # noise was built after the optimizer's weights were swapped for fp32 copies, so a bad seed failed
    # half way; under moments=bf16-sr it failed inside torch.Generator.manual_seed; elsewhere it was unused.
    # A ValueError, as the stochastic rounding's own check has always raised.
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int (the stochastic-rounding seed, e.g. seed=0), got {seed!r}"
                         + ("; pass seed=int(seed)" if isinstance(seed, numbers.Integral)
                            and not isinstance(seed, bool) else ""))
    if fp8_filter is not None and not callable(fp8_filter):
        raise TypeError(f"fp8_filter must be a function fp8_filter(name, module) -> bool (False keeps a "
                        f"layer out of fp8) or None, got {fp8_filter!r}")
    _check_process_group(process_group)


def _check_process_group(process_group: Any) -> None:
    """TypeError for a ``process_group`` that is neither "auto", None nor a torch.distributed group (it
    would be accepted here and fail inside torch at the first step's all_reduce)."""
    if process_group is None or (isinstance(process_group, str) and process_group == GroupChoice.AUTO):
        return
    dist = torch.distributed
    if dist.is_available() and isinstance(process_group, dist.ProcessGroup):
        return
    raise TypeError(f"process_group must be 'auto' (detect FSDP2 and DDP), None (keep the overflow flag "
                    "and norm local) or a torch.distributed ProcessGroup (e.g. dist.new_group(...)), got "
                    f"{type(process_group).__name__} {process_group!r}")


def check_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                              recipe: Recipe) -> tuple[torch.device, list[torch.Tensor]]:
    """``(device, the optimizer's tensors)``, or the TypeError/ValueError that refuses this model and
    optimizer under ``recipe``: nothing to train, tensors the model does not own, integer weights, 16-bit
    weights under a recipe that keeps them fp32, a device the recipe cannot run on, module or fp8
    patterns that match nothing. Nothing is touched."""
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to train")
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    owned = {id(p) for p in params}
    foreign = [p for p in opt_params if id(p) not in owned]
    if foreign or not opt_params:
        raise ValueError(foreign_params_message(model, optimizer, foreign, len(opt_params)))
    non_float = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if non_float:
        raise TypeError(f"parameters {non_float[:3]} are not floating point; mixed precision trains "
                        "floating-point weights only")
    # The recipe decides the weights' dtype: a 16-bit model under 'fp16' would train with no master.
    check_param_dtypes(model, recipe, low_precision_params(model, recipe))
    device = params[0].device
    support = supports(recipe, device)
    if not support.ok:
        raise ValueError(f"recipe {recipe.label!r} cannot run on {device}: {support.reason}")

    # Patterns that match nothing are typos: refused here, before the optimizer or model is touched.
    check_module_patterns(model, recipe)
    if recipe.fp8 is not None:
        check_fp8_patterns(model, recipe.fp8)
    return device, opt_params

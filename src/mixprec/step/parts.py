"""The engine's parts, built once by ``MixedPrecision(...)`` after its arguments passed (``engine_args.py``).

``prepare_model`` readies the model and the optimizer for the recipe, in the order the numbers need: the
fp32 copies are cloned from the still-fp32 weights (``update/master.py``) and the optimizer pointed at
them, compact moments set up (``update/compact_adamw.py``), eligible layers swapped for fp8 ones
(``fp8/swap.py``), and only then the weights cast and the casting hooks installed (``casting/model.py``).

``decide_once`` sets on the engine what ``autocast()``, ``backward()`` and ``step()`` read instead of
deciding at every call: the loss scale and its kind as flags, the NaN/Inf tracer, whether torch.autocast
alone is entered (then one ``_ReusedAutocast`` serves every step), the usage checks, and the parameters
``zero_grad()`` clears beyond the optimizer's. Both run once, at construction: neither is on a step's path.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..casting.model import cast_model, keeps_fp32, low_precision_params
from ..casting.oplists import op_list_mode
from ..casting.saved16 import Saved
from ..fp8.backends import Fp8EmulationWarning, resolve_backends
from ..fp8.swap import swap_to_fp8
from ..fp8.swap_report import none_swapped_reason
from ..guards.nonfinite import NonfiniteTracer
from ..guards.usage import UsageChecks, bare_step_reason, remember_engine
from ..loss_scale.per_layer import LayerLossScale
from ..loss_scale.scales import DynamicLossScale, NoLossScale, make_loss_scale
from ..recipe import Precision
from ..recipe.moments import Moments
from ..update.compact_adamw import CompactAdamW
from ..update.master import MasterWeights
from .grad_norm import GradNorm
from .grad_sync import GradSync

if TYPE_CHECKING:
    from ..engine import MixedPrecision
    from ..fp8.swap_report import Fp8SwapReport
    from ..recipe import Recipe

__all__ = ["prepare_model", "decide_once"]


class _ReusedAutocast(torch.autocast):
    """The engine's one ``torch.autocast``, entered at every step: building one costs more host work
    than entering it (on CUDA torch asks the device for bf16 support at each construction). torch's
    ``__enter__`` and ``__exit__`` save and restore the autocast state on the instance, so one instance
    is safe to enter again once exited; ``entered`` says whether it is in use now."""

    entered = False

    def __enter__(self):
        self.entered = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.entered = False
        return super().__exit__(*exc)


def prepare_model(model: nn.Module, optimizer: torch.optim.Optimizer, recipe: Recipe, device: torch.device,
                  opt_params: list[torch.Tensor], *, seed: int,
                  fp8_filter: Callable[[str, nn.Module], bool] | None, process_group: Any,
                  ) -> tuple[GradSync, MasterWeights | None, CompactAdamW | None, Fp8SwapReport | None, Any]:
    """``(grad_sync, master, moments, fp8_report, hooks)``: ``model`` and ``optimizer`` prepared in place
    for ``recipe`` (the module docstring). Its warnings name the line that called ``MixedPrecision(...)``."""
    in_optimizer = {id(p) for p in opt_params}
    low = [p for p in low_precision_params(model, recipe) if id(p) in in_optimizer]
    # Across ranks: how the gradient norm is reduced (mixprec.distributed). Under FSDP2 the sharded
    # fp32 parameters are the master copy and FSDP casts the gathered weights: no cast, no master.
    grad_sync = GradSync.for_model(model, recipe, process_group)
    master = None
    if recipe.param.is_low and not grad_sync.fsdp:
        master = MasterWeights(low, optimizer, keep=recipe.master is not None,
                               rounding=recipe.rounding, seed=seed)
    # moments=bf16|bf16-sr|fp8: the engine steps its own AdamW with compact moments (update/compact_adamw.py).
    moments = None
    if recipe.moments is not Moments.FP32:
        if grad_sync.fsdp:
            raise ValueError(f"moments={recipe.moments.value} is not supported under FSDP2 yet; "
                             "use moments=fp32 there")
        moments = CompactAdamW(optimizer, recipe.moments, seed=seed,
                               numel=master.numel_of if master else torch.Tensor.numel)
    fp8_report = None
    if recipe.fp8 is not None:
        # A backend per scaling: ``layers=`` rules may mix formats with and without a kernel here.
        backend, note = resolve_backends(recipe.fp8, device)
        if note and "emulate" in backend.values():    # the notice: fp8 runs, but emulated, and why
            warnings.warn(note, Fp8EmulationWarning, stacklevel=3)
        keeps = (lambda m: keeps_fp32(m, recipe)) if recipe.param.is_low else None
        fp8_report = swap_to_fp8(model, recipe.fp8, backend=backend, note=note,
                                 filter=fp8_filter, keeps_fp32=keeps)
        none_swapped = none_swapped_reason(fp8_report, recipe.label)
        if none_swapped is not None:
            warnings.warn(none_swapped, UserWarning, stacklevel=3)
    elif fp8_filter is not None:
        raise ValueError(f"fp8_filter was given but recipe {recipe.label!r} has no fp8; use an fp8 "
                         "recipe (e.g. 'fp8') or drop fp8_filter")
    hooks = cast_model(model, recipe, device.type, cast_params=not grad_sync.fsdp)
    return grad_sync, master, moments, fp8_report, hooks


def decide_once(mp: MixedPrecision, model: nn.Module, optimizer: torch.optim.Optimizer,
                trace_nonfinite: bool) -> None:
    """Set on ``mp`` what its forward, backward and step read, decided here once (the module docstring)."""
    # saved=exact|low with 16-bit compute: some fp32 activations it saves are kept in 16 bits
    # (casting/saved16.py). Off by default: nothing is installed.
    mp._packs_saved = mp.recipe.saved is not Saved.FP32 and (
        mp.recipe.compute.is_low or any(p.is_low for _, p in mp.recipe.modules))
    # Whether the first backward still has to look for a compiled region, where saved= does not apply.
    mp._saved_compile_check = mp._packs_saved
    # None with autocast's default lists: then no per-op Python work runs in the forward.
    mp._op_mode = op_list_mode(mp.recipe.op_edits, mp.device.type)
    mp.loss_scale = make_loss_scale(mp.recipe.loss_scale, mp.device)
    # The loss scale's kind is fixed at construction (load_state_dict loads into it): step() reads
    # these flags rather than asking isinstance at every step.
    mp._layer_scale = isinstance(mp.loss_scale, LayerLossScale)
    mp._dynamic_scale = isinstance(mp.loss_scale, DynamicLossScale)
    mp._scaled = not isinstance(mp.loss_scale, NoLossScale)    # S may differ from 1
    mp._clip_multiplier = None    # unscale_and_clip's clip / S, per step
    if mp._layer_scale:
        mp.loss_scale.attach(mp)     # scale=per-layer: hooks on each layer (loss_scale/per_layer.py)
    mp._grad_norm = GradNorm()     # the chunked pure step's norm: 16-bit gradients, no fp32 copies
    mp._nonfinite = None
    mp._overflow_check = None    # (found_inf, scale, traced ops) of the last step
    mp._overflow = None
    if trace_nonfinite:
        mp._nonfinite = NonfiniteTracer(model)
    # Decided here, not at every step: what autocast() and backward() enter beyond torch's own.
    mp._compute_dtype = mp.recipe.compute.dtype
    mp._autocast_on = mp.recipe.autocast
    sets_tf32 = mp.recipe.compute in (Precision.FP32, Precision.TF32)
    mp._backward_alone = mp._nonfinite is None and not sets_tf32
    mp._autocast_alone = mp._backward_alone and mp._op_mode is None and not mp._packs_saved
    # One torch.autocast for every step (_ReusedAutocast); building it is most of autocast()'s host
    # work on CUDA (torch checks the device's bf16 support each time: 39 of 48 calls, H200).
    mp._autocast_ctx = (_ReusedAutocast(mp.device.type, dtype=mp._compute_dtype)
                        if mp._autocast_alone and mp._autocast_on else None)
    # Misuse that would train on silently wrong (usage_checks): flags and counters, no host sync.
    mp._checks = UsageChecks(mp.recipe, mp._scaled, mp.device)
    mp._checks.traced = trace_nonfinite
    mp._checks.remember_dtype(model)     # model.half() after this point is refused at step()
    # A bare optimizer.step() where only mp.step() steps right (a loss scale, fp32 copies, compact
    # moments) raises; nothing is installed where it is correct (bf16, fp32).
    mp._checks.guard_optimizer(optimizer, bare_step_reason(mp.recipe, mp._scaled, mp.master is not None,
                                                           mp.moments is not None))
    # What zero_grad() clears beyond the optimizer's own zero_grad (fp32 copies replaced their weights).
    mp._params = list(model.parameters())      # the Parameters stay; fp8 layers share them
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    mp._outside_optimizer = [p for p in mp._params if id(p) not in held]
    # optimizer.add_param_group() after this point is refused at step() (one int compare per step).
    mp._checks.watch_optimizer(optimizer, held | {id(p) for p in mp._params if p.dtype == torch.float32})
    remember_engine(model, mp)
    # add_step_observer; empty: step() calls nothing. An OrderedDict: RemovableHandle weak-refs it.
    mp._step_observers = collections.OrderedDict()

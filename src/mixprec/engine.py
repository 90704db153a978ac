"""MixedPrecision: one object that ties a recipe, a model, an optimizer and a loss scale together.

    mp = MixedPrecision(model, optimizer, recipe="fp16")
    for x, y in loader:
        with mp.autocast():
            loss = loss_fn(model(x), y)
        mp.backward(loss)      # loss * S, backward
        result = mp.step()     # one read of the gradients, then step or skip, then the scale update
        mp.zero_grad()

``step()`` reads the gradients once: a global norm of the still-scaled gradients is inf or NaN exactly
when some gradient is, so the overflow check and clipping share that pass. Then either

- the fused path (torch's fused Adam/AdamW/SGD): the optimizer gets ``grad_scale = S / clip`` and
  ``found_inf`` and divides, clips and skips inside its own kernel: no host sync, no extra pass; or
- the generic path (any other optimizer): one host sync to learn whether to skip, one in-place
  multiply by ``clip / S``, then ``optimizer.step()``.

A skipped step leaves weights, master weights, optimizer state and step counters bitwise as they were.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .casting.model import cast_model, check_module_patterns, keeps_fp32, low_precision_params
from .checkpoint.check import check_engine_state
from .update.compact_adamw import CompactAdamW
from .devices import supports
from .step.grad_norm import GradNorm
from .step.grad_sync import GradSync, GroupChoice, SyncKind
from .checkpoint.export import fp32_state_dict
from .fp8.state import fp8_state_dict, load_fp8_state_dict
from .fp8.swap import check_fp8_patterns, resolve_backends, swap_to_fp8
from .fp8.swap_report import Fp8SwapReport, none_swapped_reason
from .loss_scale.per_layer import LayerLossScale
from .loss_scale.scales import DynamicLossScale, LossScale, NoLossScale, ScaleInBackward, make_loss_scale
from .update.master import MasterWeights
from .guards.nonfinite import NonfiniteOrigin, NonfiniteTracer, first_nonfinite
from .casting.oplists import op_list_mode
from .step.optimizer import (fused_kernel_for, fused_optimizer_step, generic_optimizer_step,
                             host_fused_optimizer_step, master_whole, unscale_and_clip)
from .recipe import Precision, Recipe, get_recipe
from .engine_args import check_arguments
from .guards.usage import (UsageChecks, bare_step_reason, check_loss_tensor, check_param_dtypes,
                           foreign_params_message, frozen_model_message, no_grads_message, remember_engine)
from .recipe.moments import Moments
from .casting.saved16 import Saved, SavedPacker, warn_if_compiled_saves
from .step.result import StepObserver, StepResult
from .casting.tf32 import fp32_precision

__all__ = ["MixedPrecision", "StepResult", "StepObserver", "Fp8EmulationWarning"]


class Fp8EmulationWarning(UserWarning):
    """An fp8 recipe runs emulated (exact fp8 rounding, fp32 matmuls) on a device without fp8 matmuls."""


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


class MixedPrecision:
    """Train ``model`` with ``optimizer`` under ``recipe`` (a name, a recipe string or a Recipe).

    On construction the model is prepared in place for the recipe (pure recipes cast its weights and
    install casting hooks) and, for recipes with a master copy or stochastic rounding, the optimizer's
    references to the low-precision weights are replaced by fp32 copies. ``clip_grad_norm`` clips the
    global L2 norm of the *unscaled* gradients.

    fp8 recipes swap eligible ``nn.Linear`` layers for ``Fp8Linear`` here (sharing their Parameters),
    and under per-tensor fp8 run a Hugging Face mixture of experts' 3-D expert weights as fp8 grouped
    GEMMs (``fp8/experts.py``); ``fp8_filter(name, module) -> bool`` keeps layers out, and ``fp8_report`` says what was swapped and
    why the rest was not. Where the device has no fp8 matmuls, or (on a CPU) a measured probe finds
    torch's fp8 kernel slower than the emulation, the emulation runs and an ``Fp8EmulationWarning``
    says so, once, here (``fp8_report.note`` names the choice and the measurement).

    ``trace_nonfinite=True`` watches every op of the forward (inside ``autocast()``) and the backward
    (inside ``backward()``) and, after a step whose gradients were not finite, ``last_overflow`` names
    the module and aten op where the first inf/NaN appeared (``mixprec.guards.nonfinite``). Off by
    default; off installs nothing.

    ``process_group`` says how the overflow flag and that norm are shared across ranks, so every
    rank skips, clips and updates its loss scale alike (mixprec.distributed): ``"auto"`` detects
    FSDP2 (DTensor parameters) and DDP modules, and ``wrap_ddp(engine)`` switches a plain model's
    engine over; a group shares them over that group; ``None`` keeps them local.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: str | Recipe = "fp16",
                 *, clip_grad_norm: float | None = None, seed: int = 0,
                 fp8_filter: Callable[[str, nn.Module], bool] | None = None,
                 trace_nonfinite: bool = False,
                 process_group: Any = GroupChoice.AUTO) -> None:
        self.recipe = get_recipe(recipe)
        check_arguments(model, optimizer, clip_grad_norm, fp8_filter, trace_nonfinite, process_group, seed)
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
        check_param_dtypes(model, self.recipe, low_precision_params(model, self.recipe))
        self.device = params[0].device
        self._on_cpu = self.device.type == "cpu"
        support = supports(self.recipe, self.device)
        if not support.ok:
            raise ValueError(f"recipe {self.recipe.label!r} cannot run on {self.device}: {support.reason}")

        # Patterns that match nothing are typos: refused here, before the optimizer or model is touched.
        check_module_patterns(model, self.recipe)
        if self.recipe.fp8 is not None:
            check_fp8_patterns(model, self.recipe.fp8)
        self.model = model
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        in_optimizer = {id(p) for p in opt_params}
        low = [p for p in low_precision_params(model, self.recipe) if id(p) in in_optimizer]
        # Across ranks: how the gradient norm is reduced (mixprec.distributed). Under FSDP2 the sharded
        # fp32 parameters are the master copy and FSDP casts the gathered weights: no cast, no master.
        self.grad_sync = GradSync.for_model(model, self.recipe, process_group)
        self.master: MasterWeights | None = None
        if self.recipe.param.is_low and not self.grad_sync.fsdp:
            self.master = MasterWeights(low, optimizer, keep=self.recipe.master is not None,
                                        rounding=self.recipe.rounding, seed=seed)
        # moments=bf16|bf16-sr|fp8: the engine steps its own AdamW with compact moments (update/compact_adamw.py).
        self.moments: CompactAdamW | None = None
        if self.recipe.moments is not Moments.FP32:
            if self.grad_sync.fsdp:
                raise ValueError(f"moments={self.recipe.moments.value} is not supported under FSDP2 yet; "
                                 "use moments=fp32 there")
            self.moments = CompactAdamW(optimizer, self.recipe.moments, seed=seed,
                                        numel=self.master.numel_of if self.master else torch.Tensor.numel)
        self.fp8_report: Fp8SwapReport | None = None
        if self.recipe.fp8 is not None:
            # A backend per scaling: ``layers=`` rules may mix formats with and without a kernel here.
            backend, note = resolve_backends(self.recipe.fp8, self.device)
            if note and "emulate" in backend.values():    # the notice: fp8 runs, but emulated, and why
                warnings.warn(note, Fp8EmulationWarning, stacklevel=2)
            keeps = (lambda m: keeps_fp32(m, self.recipe)) if self.recipe.param.is_low else None
            self.fp8_report = swap_to_fp8(model, self.recipe.fp8, backend=backend, note=note,
                                          filter=fp8_filter, keeps_fp32=keeps)
            none_swapped = none_swapped_reason(self.fp8_report, self.recipe.label)
            if none_swapped is not None:
                warnings.warn(none_swapped, UserWarning, stacklevel=2)
        elif fp8_filter is not None:
            raise ValueError(f"fp8_filter was given but recipe {self.recipe.label!r} has no fp8; use an fp8 "
                             "recipe (e.g. 'fp8') or drop fp8_filter")
        self._hooks = cast_model(model, self.recipe, self.device.type,
                                 cast_params=not self.grad_sync.fsdp)
        # saved=exact|low with 16-bit compute: some fp32 activations it saves are kept in 16 bits
        # (casting/saved16.py). Off by default: nothing is installed.
        self._packs_saved = self.recipe.saved is not Saved.FP32 and (
            self.recipe.compute.is_low or any(p.is_low for _, p in self.recipe.modules))
        # Whether the first backward still has to look for a compiled region, where saved= does not apply.
        self._saved_compile_check = self._packs_saved
        # None with autocast's default lists: then no per-op Python work runs in the forward.
        self._op_mode = op_list_mode(self.recipe.op_edits, self.device.type)
        self.loss_scale: LossScale = make_loss_scale(self.recipe.loss_scale, self.device)
        # The loss scale's kind is fixed at construction (load_state_dict loads into it): step() reads
        # these flags rather than asking isinstance at every step.
        self._layer_scale = isinstance(self.loss_scale, LayerLossScale)
        self._dynamic_scale = isinstance(self.loss_scale, DynamicLossScale)
        self._scaled = not isinstance(self.loss_scale, NoLossScale)    # S may differ from 1
        self._clip_multiplier: torch.Tensor | None = None    # unscale_and_clip's clip / S, per step
        if self._layer_scale:
            self.loss_scale.attach(self)     # scale=per-layer: hooks on each layer (loss_scale/per_layer.py)
        self._grad_norm = GradNorm()     # the chunked pure step's norm: 16-bit gradients, no fp32 copies
        self._nonfinite = None
        self._overflow_check: tuple | None = None    # (found_inf, scale, traced ops) of the last step
        self._overflow = None
        if trace_nonfinite:
            self._nonfinite = NonfiniteTracer(model)
        # Decided here, not at every step: what autocast() and backward() enter beyond torch's own.
        self._compute_dtype = self.recipe.compute.dtype
        self._autocast_on = self.recipe.autocast
        sets_tf32 = self.recipe.compute in (Precision.FP32, Precision.TF32)
        self._backward_alone = self._nonfinite is None and not sets_tf32
        self._autocast_alone = self._backward_alone and self._op_mode is None and not self._packs_saved
        # One torch.autocast for every step (_ReusedAutocast); building it is most of autocast()'s host
        # work on CUDA (torch checks the device's bf16 support each time: 39 of 48 calls, H200).
        self._autocast_ctx = (_ReusedAutocast(self.device.type, dtype=self._compute_dtype)
                              if self._autocast_alone and self._autocast_on else None)
        # Misuse that would train on silently wrong (usage_checks): flags and counters, no host sync.
        self._checks = UsageChecks(self.recipe, self._scaled, self.device)
        self._checks.traced = trace_nonfinite
        self._checks.remember_dtype(model)     # model.half() after this point is refused at step()
        # A bare optimizer.step() where only mp.step() steps right (a loss scale, fp32 copies, compact
        # moments) raises; nothing is installed where it is correct (bf16, fp32).
        self._checks.guard_optimizer(optimizer, bare_step_reason(
            self.recipe, self._scaled, self.master is not None,
            self.moments is not None))
        # What zero_grad() clears beyond the optimizer's own zero_grad (fp32 copies replaced their weights).
        self._params = list(model.parameters())      # the Parameters stay; fp8 layers share them
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._outside_optimizer = [p for p in self._params if id(p) not in held]
        # optimizer.add_param_group() after this point is refused at step() (one int compare per step).
        self._checks.watch_optimizer(optimizer, held | {id(p) for p in self._params if p.dtype == torch.float32})
        remember_engine(model, self)
        # add_step_observer; empty: step() calls nothing. An OrderedDict: RemovableHandle weak-refs it.
        self._step_observers: collections.OrderedDict[int, StepObserver] = collections.OrderedDict()
        self._compiled_step: Any = None     # compile_step() sets a step_compile.CompiledStep

    # ------------------------------------------------------------------ forward
    def autocast(self) -> contextlib.AbstractContextManager:
        """Run the forward pass in the recipe's compute precision.

        torch.autocast does the per-op casting for fp16/bf16 compute; a recipe's op-list edits that
        differ from autocast's lists are applied on top (``oplists.OpListMode``). The ``fp32`` and
        ``tf32`` recipes set torch's (global) TF32 switches for the forward and restore them on exit;
        the others leave them as the user set them, as torch.autocast does (``casting/tf32.py``).

        Where the engine adds nothing to torch.autocast (no op-list edits, TF32 switches, NaN tracing
        or 16-bit saves: decided at construction), the context is torch.autocast itself, as in
        torch.amp's loop; the usage checks run when it is made.
        """
        self._checks.check_dtype()      # model.half() after the engine: refused before the forward fails
        self._checks.entered_autocast = True
        if self._autocast_alone:
            ctx = self._autocast_ctx
            # Reused unless it is entered now (a nested mp.autocast() builds its own, as does another
            # thread's step that finds it in use) or torch.compile traces this call (Dynamo builds
            # the context it enters).
            if ctx is not None and not ctx.entered and not torch.compiler.is_compiling():
                return ctx
            return torch.autocast(self.device.type, dtype=self._compute_dtype, enabled=self._autocast_on)
        return self._autocast_with_extras()

    @contextlib.contextmanager
    def _autocast_with_extras(self) -> Iterator[None]:
        # Inside a function torch.compile traces, the graph decides what it saves (casting/saved16.py): the
        # saved_tensors_hooks would only break the graph.
        packs = self._packs_saved and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        with torch.autocast(self.device.type, dtype=self._compute_dtype, enabled=self._autocast_on), \
                self._fp32_precision(), \
                self._op_mode or contextlib.nullcontext(), \
                (self._nonfinite.tracing() if self._nonfinite and torch.is_grad_enabled()
                 else contextlib.nullcontext()), \
                (SavedPacker(self.recipe.saved) if packs
                 else contextlib.nullcontext()):     # fp32 saves kept in 16 bits (casting/saved16.py)
            yield

    # ----------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss * S).backward()``. Call it several times before ``step()`` to accumulate. No sync."""
        check_loss_tensor(loss, "backward")
        if loss.ndim and loss.numel() != 1:     # a 0-d loss (the usual) has one element: no call
            raise ValueError(f"the loss must be a single number, got shape {tuple(loss.shape)}: reduce it "
                             "first, e.g. loss.mean()")
        if not loss.requires_grad:
            raise ValueError(frozen_model_message(self.model) or "the loss does not require grad: was it "
                             "computed under torch.no_grad() or from detached tensors?")
        self._checks.on_backward()     # warns once if the forward ran outside mp.autocast()
        if self._saved_compile_check:
            self._saved_compile_check = False
            warn_if_compiled_saves(loss, self.recipe.saved)     # once: saved= stops at compiled regions
        if self._backward_alone:     # no NaN tracing, no TF32 switches: nothing to enter
            # Without a loss scale S is exactly 1 and NoLossScale.scale hands the loss back: not called.
            (self.loss_scale.scale(loss) if self._scaled else loss).backward(**kwargs)
            return
        with self._nonfinite.tracing(backward=True) if self._nonfinite else contextlib.nullcontext(), \
                self._fp32_precision():
            self.loss_scale.scale(loss).backward(**kwargs)

    def _fp32_precision(self) -> contextlib.AbstractContextManager:
        """TF32 on (``tf32``) or off (``fp32``) for this recipe's forward or backward; for the others
        nothing (``casting/tf32.py``). Not inside a function torch.compile traces: dynamo cannot read the
        switches there, and the compiled code runs under those set where it is called."""
        compute = self.recipe.compute
        if (compute is Precision.FP32 or compute is Precision.TF32) and not torch.compiler.is_compiling():
            return fp32_precision(tf32=compute is Precision.TF32)
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor, *, in_backward: bool = False) -> torch.Tensor:
        """``loss * S``, for a trainer that runs the backward itself (Lightning, Hugging Face). No sync.

        The gradients that backward makes count as ``mp.backward``'s (the usage checks accept them).
        ``in_backward=True`` returns the loss unchanged, for logging, and multiplies by ``S`` in its
        backward instead (``loss_scale.ScaleInBackward``).
        """
        check_loss_tensor(loss, "scale_loss")
        self._checks.on_backward()     # warns once if the forward ran outside mp.autocast()
        if in_backward:
            return ScaleInBackward.apply(loss, self.loss_scale.value)
        return self.loss_scale.scale(loss)

    # --------------------------------------------------------------------- step
    def step(self) -> StepResult:
        """Unscale, clip, check for overflow, then step or skip, then update the scale.

        Forces one host sync on the generic path (to decide whether to call ``optimizer.step()``),
        none on the fused path. The result's properties sync when read. Gradients that did not come
        from ``mp.backward`` under a loss scale, or that a step already applied, are refused first
        (RuntimeError, nothing changed; ``usage_checks``).
        """
        model_grads = [p.grad for p in self._params if p.grad is not None]   # as _model_grads(), inline
        if not model_grads:
            raise RuntimeError(no_grads_message(self.model, self._checks))
        self._checks.check_before_step(model_grads)   # stale or unscaled gradients: refused here
        # fp32 copies whole when observers read them or the step is compiled; else chunk by chunk.
        whole = self.master is not None and master_whole(self)
        if whole:
            self.master.pull_grads()
        elif self.master is not None:
            self.master.begin_step(self.optimizer)   # CPU: the first chunk's fp32 casts are made here
        # What backward made, in the optimizer's order: with fp32 copies stepped in chunks the 16-bit
        # gradients (cast to fp32 chunk by chunk inside the step; on CPU the first chunk's casts).
        # optimizer_grads(), inline, with ``whole`` already known.
        if self.master is not None and not whole:
            grads = self.master.grads(self.optimizer)
        else:
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self._layer_scale:
            self.loss_scale.unscale_layers()     # each layer's factor divided out: every gradient at S
        # The scale this step's gradients carry (a copy: the compiled step updates it in place).
        scale = self.loss_scale.value.detach().clone() if self._nonfinite is not None else None
        observers = self._step_observers
        if observers:
            for observer in observers.values():
                observer.before_step(self)      # gradients as backward left them: still scaled by S
        kernel = fused_kernel_for(self)     # the optimizer whose fused kernel steps; None: generic
        fused = kernel is not None
        compiled = self._compiled_step is not None and fused
        if compiled:
            found_inf, grad_norm = self._compiled_step(grads)
            stepped = None      # decided on the device: no host sync
        elif fused and self._on_cpu:
            found_inf, grad_norm, divisor = unscale_and_clip(self, grads)
            stepped = host_fused_optimizer_step(self, divisor, found_inf, kernel)   # a CPU read: no wait
        elif fused:
            found_inf, grad_norm, divisor = unscale_and_clip(self, grads)
            fused_optimizer_step(self, divisor, found_inf.to(torch.float32), kernel)
            stepped = None      # decided on the device: no host sync
        else:
            found_inf, grad_norm, divisor = unscale_and_clip(self, grads)
            stepped = generic_optimizer_step(self, grads, divisor, found_inf)
        if observers:
            for observer in observers.values():
                observer.after_step(self, found_inf)   # before fp32 copies are rounded into the model
        if self.master is not None and whole and (stepped is not False or not self.master.keep):
            # Chunked steps rounded each chunk into the model already. found_inf: a skipped step does
            # not advance bf16-sr's rounding noise (a run that skipped equals one that never saw it).
            self.master.push_weights(found_inf=found_inf)
        if self._nonfinite is not None:
            # Keep what last_overflow needs (this step's traced ops) until the next step() replaces it.
            self._overflow_check = (found_inf, scale, self._nonfinite.take())
            self._overflow = None
        if not compiled:     # the compiled step updates the scale inside its graph
            self.loss_scale.update(found_inf, None if stepped is None else not stepped)
        if stepped is False and self._dynamic_scale:
            self.loss_scale.warn_if_at_floor()
        self._checks.after_step(model_grads, found_inf, stepped)   # warns after 10 skips in a row
        # Only a dynamic scale changes S in place afterwards: the others' S is this step's as it is.
        scale_after = self.loss_scale.value
        if self._dynamic_scale:
            scale_after = scale_after.clone()
        return StepResult(found_inf, scale_after, grad_norm)

    def compile_step(self, **options: Any) -> MixedPrecision:
        """Run every later ``step()`` as one ``torch.compile`` graph; returns the engine.

        The norm, clip, overflow check, fused optimizer step and loss-scale update compile together
        (``mixprec.step.compiled``): no host sync, and with ``mode="reduce-overhead"`` CUDA-graph
        replays. With the model compiled in that mode too, keep ``zero_grad()``'s default
        (``set_to_none=True``) and call ``torch.compiler.cudagraph_mark_step_begin()`` before each
        step's forward, as torch asks of any such loop: kept gradients would be outputs of the model's
        CUDA graph that its next replay overwrites. ``options`` go to ``torch.compile``. Needs an
        optimizer built with ``fused=True`` (Adam, AdamW, SGD).
        """
        from .step.compiled import CompiledStep
        self._compiled_step = CompiledStep(self, options)
        return self

    def _model_grads(self) -> list[torch.Tensor]:
        """The gradients backward left on the model's own parameters (not the fp32 copies). The
        parameters are listed once, at construction: walking the modules each step cost more than the
        tiny model's optimizer step."""
        return [p.grad for p in self._params if p.grad is not None]

    @property
    def last_overflow(self) -> NonfiniteOrigin | None:
        """Where the last step's first inf/NaN appeared (a ``NonfiniteOrigin``); None if it was clean
        (or if no traced op produced it: e.g. non-finite gradients accumulated before tracing).

        Needs ``trace_nonfinite=True``. Syncs with the host (reads the overflow flag and, only if it
        is set, the traced ops' ranges). Refers to the last ``step()`` until the next one.
        """
        if self._nonfinite is None:
            raise ValueError("last_overflow needs the NaN/Inf tracer: build the engine with "
                             "MixedPrecision(..., trace_nonfinite=True)")
        if self._overflow_check is None:
            return None
        found_inf, scale, records = self._overflow_check
        if self._overflow is None and bool(found_inf):
            self._overflow = first_nonfinite(records, loss_scale=float(scale))
        return self._overflow

    def add_step_observer(self, observer: StepObserver) -> RemovableHandle:
        """Call ``observer.before_step(engine)`` and ``observer.after_step(engine, found_inf)`` in every step.

        ``before_step`` runs once the gradients are gathered (fp32 copies filled) and still scaled by
        the loss scale ``engine.loss_scale.value``; ``after_step`` once the optimizer has stepped or
        skipped (``found_inf``, a () bool tensor, says which) and before fp32 copies are rounded into
        the model. For diagnostics (``mixprec.diagnostics.RangeCollector``); ``handle.remove()`` detaches
        it. With no observer, step() does nothing extra.
        """
        missing = [m for m in ("before_step", "after_step") if not callable(getattr(observer, m, None))]
        if missing:
            raise TypeError(f"a step observer needs methods before_step(engine) and after_step(engine, "
                            f"found_inf); {type(observer).__name__} has no {' or '.join(missing)} (see "
                            "mixprec.StepObserver; mixprec.diagnostics.RangeCollector is one)")
        handle = RemovableHandle(self._step_observers)
        self._step_observers[handle.id] = observer
        return handle

    def install_grad_sync(self, sync: GradSync) -> None:
        """Reduce the gradient norm and overflow flag with ``sync`` from the next ``step()`` on.

        ``mixprec.distributed.wrap_ddp`` builds the replicated ``GradSync`` for a model it wrapped after
        this engine was built on the plain model; the engine only ever changes its own state here.
        """
        if not isinstance(sync, GradSync):
            raise TypeError(f"install_grad_sync takes a GradSync, got {type(sync).__name__}")
        if self.grad_sync.kind is not SyncKind.LOCAL:
            raise ValueError(f"this engine already reduces over ranks ({self.grad_sync.kind.value}); "
                             "a GradSync is installed once, on an engine built on the plain model")
        self.grad_sync = sync

    # ----------------------------------------------------------------- helpers
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and those of the fp32 copies: the optimizer's ``zero_grad``, then
        the model's parameters the optimizer does not hold (16-bit weights behind fp32 copies, weights
        left out of it), listed once at construction rather than walked each step."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self._outside_optimizer:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:     # as nn.Module.zero_grad does it
                p.grad.detach_() if p.grad.grad_fn is not None else p.grad.requires_grad_(False)
                p.grad.zero_()
        if self.master is not None:
            self.master.zero_grad(set_to_none)

    @property
    def scale(self) -> float:
        """The current loss scale. Syncs with the host."""
        return float(self.loss_scale.value)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far for non-finite gradients. Syncs with the host."""
        return int(self.loss_scale.skipped)

    @property
    def steps(self) -> int:
        """``step()`` calls so far, skipped ones included. Syncs with the host."""
        return int(self.loss_scale.steps)

    def state_dict(self) -> dict[str, Any]:
        """Everything mixprec owns: recipe, loss scale, master weights, stochastic-rounding generator,
        fp8 scale state (scales, amax histories) per fp8 layer, compact Adam moments (``moments=``).

        The model's and the optimizer's own state dicts are theirs to save (``save_checkpoint`` saves
        all of it together).
        """
        return {"recipe": str(self.recipe), "loss_scale": self.loss_scale.state_dict(),
                "master": self.master.state_dict() if self.master is not None else None,
                "fp8": fp8_state_dict(self.model) if self.fp8_report is not None else None,
                "moments": self.moments.state_dict() if self.moments is not None else None}

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights for an fp32 model: master copies where the recipe keeps them, every
        other float upcast (exact). Under pure recipes ``model.state_dict()`` is 16-bit. See ``export``."""
        return fp32_state_dict(self)

    def load_model_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load model weights (e.g. fp32 pretrained ones) at fp32 precision; returns torch's result.

        ``model.load_state_dict`` works under every recipe (the engine takes a changed weight as the
        truth at the next step: ``MasterWeights.adopt_model_changes``), but under a pure recipe it
        rounds the values into the 16-bit weights first, so the masters start from the rounding. This
        loads through the model (torch checks the keys and shapes), then puts each fp32 value into the
        weight's master (under bf16-kahan: weight and compensation, the exact fp32 value), the 16-bit
        weight its rounding. Without fp32 copies it is ``model.load_state_dict``.
        """
        result = self.model.load_state_dict(state_dict, strict=strict)
        if self.master is not None:
            position = {id(p): i for i, p in enumerate(self.master.model_params)}
            for key, param in self.model.state_dict(keep_vars=True).items():
                if id(param) in position and key in state_dict:
                    self.master.load_fp32_(position[id(param)], state_dict[key])
        return result

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a misfit is a ValueError and changes nothing."""
        check_engine_state(self, state)     # recipe, loss scale, masters, fp8: all checked first
        self.loss_scale.load_state_dict(state["loss_scale"])
        if self.master is not None:
            self.master.load_state_dict(state["master"])
        if self.fp8_report is not None:
            load_fp8_state_dict(self.model, state["fp8"])
        if self.moments is not None:
            self.moments.load_state_dict(state["moments"])


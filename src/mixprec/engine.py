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

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .checkpoint.engine_state import engine_state_dict, load_engine_state, load_model_state
from .checkpoint.export import fp32_state_dict
from .engine_args import check_arguments, check_model_and_optimizer
from .fp8.backends import Fp8EmulationWarning
from .guards.nonfinite import NonfiniteOrigin, first_nonfinite
from .guards.usage import check_loss_tensor, frozen_model_message, no_grads_message
from .loss_scale.scales import ScaleInBackward
from .recipe import Precision, Recipe, get_recipe
from .casting.saved16 import SavedPacker, warn_if_compiled_saves
from .casting.tf32 import fp32_precision
from .step.grad_sync import GroupChoice, check_installable
from .step.optimizer import (fused_kernel_for, fused_optimizer_step, generic_optimizer_step,
                             host_fused_optimizer_step, master_whole, unscale_and_clip)
from .step.parts import decide_once, prepare_model
from .step.result import StepObserver, StepResult, check_step_observer

if TYPE_CHECKING:
    from .fp8.swap import Fp8SwapReport
    from .step.grad_sync import GradSync
    from .update.compact_adamw import CompactAdamW
    from .update.master import MasterWeights

# Fp8EmulationWarning is defined beside the backend choice that warns it (fp8/backends.py); named here as before.
__all__ = ["MixedPrecision", "StepResult", "StepObserver", "Fp8EmulationWarning"]


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
        # The model, the optimizer, the recipe and the device against each other: refused before the
        # optimizer or the model is touched (engine_args.py).
        self.device, opt_params = check_model_and_optimizer(model, optimizer, self.recipe)
        self._on_cpu = self.device.type == "cpu"
        self.model = model
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        # The model and the optimizer prepared for the recipe (step/parts.py): across ranks, how the
        # gradient norm is reduced (mixprec.distributed); the fp32 copies the optimizer steps, cloned
        # before the weights are cast; compact moments (moments=); fp8 layers swapped in; weights cast.
        self.master: MasterWeights | None
        self.moments: CompactAdamW | None
        self.fp8_report: Fp8SwapReport | None
        self.grad_sync, self.master, self.moments, self.fp8_report, self._hooks = prepare_model(
            model, optimizer, self.recipe, self.device, opt_params, seed=seed, fp8_filter=fp8_filter,
            process_group=process_group)
        # What autocast(), backward() and step() read, decided once (step/parts.py): the loss scale
        # and its kind, the NaN/Inf tracer, the reused torch.autocast, the usage checks, the parameters
        # zero_grad() clears, the step observers.
        decide_once(self, model, optimizer, trace_nonfinite)
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
        check_step_observer(observer)     # the protocol's two methods (step/result.py)
        handle = RemovableHandle(self._step_observers)
        self._step_observers[handle.id] = observer
        return handle

    def install_grad_sync(self, sync: GradSync) -> None:
        """Reduce the gradient norm and overflow flag with ``sync`` from the next ``step()`` on.

        ``mixprec.distributed.wrap_ddp`` builds the replicated ``GradSync`` for a model it wrapped after
        this engine was built on the plain model; the engine only ever changes its own state here.
        """
        check_installable(self.grad_sync, sync)     # a GradSync, installed once (step/grad_sync.py)
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
        return engine_state_dict(self)      # checkpoint/engine_state.py

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
        return load_model_state(self, state_dict, strict)      # checkpoint/engine_state.py

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a misfit is a ValueError and changes nothing."""
        load_engine_state(self, state)      # all checked first (checkpoint/engine_state.py)


"""The middle of ``MixedPrecision.step()``: from the gradients backward left to the optimizer's update.

One read of the gradients gives a global norm of the still-scaled gradients (``unscale_and_clip``): it
is inf or NaN when some gradient is, and when finite gradients have a norm above 1.8e19 (the sum of
squares overflows fp32: such a step is skipped too; docs/step.md), so the overflow check and the clip
share that pass, and
``S / clip`` is the divisor the optimizer must apply. Then one of two paths:

- fused (``fused_step_ok``: torch's fused Adam, AdamW or SGD): the optimizer gets ``grad_scale`` and
  ``found_inf`` tensors and divides, clips and skips inside its own kernel; no host sync.
- generic (any other optimizer, and the engine's own AdamW for ``moments=``): one host sync to learn
  whether to call the optimizer at all, one in-place multiply of the gradients by ``clip / S``.

Either way ``update`` runs the optimizer, through the master weights' chunks where the recipe keeps
fp32 copies (``master.MasterWeights.step``), or on the fp32 copies filled whole where step observers
read them or the step is compiled (``master_whole``). These are functions of the engine, not methods,
so that ``engine.py`` keeps the loop's shape and this module the step's arithmetic; ``step_compile``
traces the same functions into its graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .grad_norm import global_norm_f32

if TYPE_CHECKING:
    from ..engine import MixedPrecision

__all__ = ["unscale_and_clip", "nonfinite", "divides", "fused_step_ok", "fused_optimizer_step",
           "host_fused_optimizer_step", "generic_optimizer_step", "skip_optimizer_step",
           "master_whole", "optimizer_grads", "update", "fused_kernel_optimizer", "fused_kernel_for"]

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does, so a zero norm gives a
# finite clip coefficient (clamped to 1 anyway).
CLIP_EPS = 1e-6
_FP32_MAX = torch.finfo(torch.float32).max


def unscale_and_clip(engine: MixedPrecision, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(found_inf, grad_norm, divisor)`` from one read of the gradients; no host sync.

    The optimizer must see ``grad / divisor``; ``divisor`` is None where that is grad itself.
    """
    scale = engine.loss_scale.value
    # Chunked fp32 copies: the norm reads 16-bit gradients, whichever chunk cast them (grad_norm).
    norm = engine._grad_norm if engine.master is not None and not master_whole(engine) else global_norm_f32
    scaled_norm = norm(grads, engine.grad_sync)   # the same on every rank
    found_inf = nonfinite(scaled_norm)
    # S is a power of two (or a user's static value): dividing the norm by it is exact or one rounding;
    # without a loss scale S is exactly 1 (a Python-level fact of NoLossScale, read from the flag the
    # engine set at construction: the loss scale's kind never changes) and nothing is divided.
    scaled = engine._scaled
    grad_norm = scaled_norm / scale if scaled else scaled_norm
    # Without a loss scale or clipping there is no division at all (divides(), inline). The clip is read
    # at every step: the user may change engine.clip_grad_norm between steps.
    divisor = scale if scaled or engine.clip_grad_norm is not None else None
    engine._clip_multiplier = None
    if engine.clip_grad_norm is not None:
        clip = (engine.clip_grad_norm / (grad_norm + CLIP_EPS)).clamp(max=1.0)
        divisor = scale / clip
        if not torch.compiler.is_compiling():
            # Eager steps multiply by clip / S (exact: S is a power of two), as torch's unscale_ then
            # clip_grad_norm_ do ((g / S) * clip: one rounding either way), so a binding clip trains
            # bit for bit like that loop; g / (S / clip) in the kernel rounds twice. The compiled step
            # keeps the divisor in its graph (docs/step.md says by how much it differs).
            engine._clip_multiplier = clip / scale
    return found_inf, grad_norm, divisor


def nonfinite(norm: torch.Tensor) -> torch.Tensor:
    """() bool: the norm is inf or NaN. Clamped to fp32's largest finite value it changes exactly
    then (NaN stays NaN, which equals nothing): two tiny ops (``~torch.isfinite`` takes five on a CPU),
    and no comparison with a Python number, which wraps the number in a tensor first (``~(norm < inf)``:
    10.9 us on this CPU, this 4.8)."""
    return norm.clamp(max=_FP32_MAX).ne(norm)


def divides(engine: MixedPrecision) -> bool:
    """Whether the optimizer must divide the gradients (a loss scale or clipping): a Python fact."""
    return engine._scaled or engine.clip_grad_norm is not None


def fused_kernel_optimizer(opt: Any) -> Any:
    """The torch optimizer whose fused kernel would read ``grad_scale`` and ``found_inf``: ``opt``
    itself, or the one inside a pass-through wrapper; None where there is none. Flag checks only.

    A pass-through wrapper (Accelerate's ``AcceleratedOptimizer``) subclasses ``Optimizer`` without
    torch's ``_step_supports_amp_scaling`` flag, holds the real optimizer as ``.optimizer``, shares
    its ``param_groups`` and calls its ``step()``. It is looked through only where that call is all it
    adds this step: no loss scaler of its own (``mixed_precision="no"``, as the engine needs anyway)
    and, under ``accelerator.accumulate``, a step that synchronises gradients (on the others the
    wrapper skips the step; the generic path lets it).
    """
    if getattr(opt, "_step_supports_amp_scaling", False):
        return opt
    inner = getattr(opt, "optimizer", None)
    if (isinstance(inner, torch.optim.Optimizer) and getattr(inner, "_step_supports_amp_scaling", False)
            and opt.param_groups is inner.param_groups and getattr(opt, "scaler", None) is None
            and getattr(getattr(opt, "gradient_state", None), "sync_gradients", True)):
        return inner
    return None


def fused_step_ok(engine: MixedPrecision) -> bool:
    """True when the optimizer can divide, clip and skip inside its own fused kernel."""
    return fused_kernel_for(engine) is not None


def fused_kernel_for(engine: MixedPrecision) -> Any:
    """The torch optimizer whose fused kernel divides, clips and skips this step (``fused_step_ok``),
    or None. Asked at every step (the user's optimizer is the truth: its groups' ``fused`` flags, an
    Accelerate wrapper's sync state); ``step()`` hands the answer on to ``fused_optimizer_step`` rather
    than asking twice."""
    if engine.moments is not None:        # the engine's own AdamW takes the generic path
        return None
    opt = fused_kernel_optimizer(engine.optimizer)
    if opt is None:
        return None
    for g in opt.param_groups:      # a loop, not all(genexpr): this runs at every step
        if not g.get("fused"):
            return None
    if isinstance(opt, torch.optim.SGD):
        # torch's fused SGD creates its momentum buffers with empty_like on the first step and
        # leaves them uninitialised if that step is skipped: take the generic path until they exist.
        if not all(g["momentum"] == 0 or "momentum_buffer" in opt.state.get(p, {})
                   for g in opt.param_groups for p in g["params"]):
            return None
    return opt


def fused_optimizer_step(engine: MixedPrecision, divisor: torch.Tensor | None,
                         found_inf_f32: torch.Tensor | None, opt: Any = None) -> None:
    """The optimizer divides by ``divisor`` and skips where ``found_inf_f32`` is 1, in its kernel
    (None: the host has decided to step). ``opt``: ``fused_kernel_for``'s answer this step, if asked."""
    # Set on the optimizer that owns the kernel; engine.optimizer.step() (a wrapper's, if any) calls it.
    if opt is None:
        opt = fused_kernel_optimizer(engine.optimizer)
    multiplier = engine._clip_multiplier    # clipping: the gradients times clip / S (set by unscale_and_clip)
    opt.grad_scale = divisor if multiplier is None else None   # type: ignore[attr-defined]
    opt.found_inf = found_inf_f32                  # type: ignore[attr-defined]
    try:
        update(engine, multiplier)
    finally:
        del opt.grad_scale, opt.found_inf          # type: ignore[attr-defined]


def generic_optimizer_step(engine: MixedPrecision, grads: list[torch.Tensor], divisor: torch.Tensor | None,
                           found_inf: torch.Tensor) -> bool:
    """Step unless ``found_inf`` (one host sync); returns whether it stepped."""
    stepped = not bool(found_inf)   # the one host sync of the generic path
    multiplier = engine._clip_multiplier    # clipping: clip / S, exact
    if stepped:
        update(engine, multiplier if multiplier is not None else None if divisor is None else 1.0 / divisor)
    else:
        skip_optimizer_step(engine)
    return stepped


def host_fused_optimizer_step(engine: MixedPrecision, divisor: torch.Tensor | None,
                              found_inf: torch.Tensor, opt: Any = None) -> bool:
    """The fused path where ``found_inf`` lives on the CPU: reading it waits on nothing, so the host
    decides, as the generic path does, and the kernel gets no ``found_inf`` to test (nor the step
    counts to take back after a skip). Returns whether it stepped."""
    stepped = not bool(found_inf)
    if stepped:
        fused_optimizer_step(engine, divisor, None, opt)
    else:
        skip_optimizer_step(engine)
    return stepped


def skip_optimizer_step(engine: MixedPrecision) -> None:
    """A step skipped on the host: nothing is touched but the bookkeeping."""
    # An LR scheduler stepping next to us would warn that optimizer.step() was never
    # called; the skip is deliberate, so mark the optimizer as torch's wrapper would.
    engine.optimizer._opt_called = True  # type: ignore[attr-defined]
    if engine.master is not None and not master_whole(engine):
        engine.master.skip_step()


def optimizer_grads(engine: MixedPrecision) -> list[torch.Tensor]:
    """The gradients the optimizer steps on: the fp32 copies' (whole) or the chunked master's view."""
    if engine.master is not None and not master_whole(engine):
        return engine.master.grads(engine.optimizer)
    return [p.grad for g in engine.optimizer.param_groups for p in g["params"] if p.grad is not None]


def master_whole(engine: MixedPrecision) -> bool:
    """fp32 copies filled whole (observers read them; a compiled step steps them in one graph; per-layer
    factors are divided out of them in fp32, where 16-bit gradients would flush again)."""
    return bool(engine._step_observers) or engine._compiled_step is not None or engine._layer_scale


def update(engine: MixedPrecision, inv_divisor: torch.Tensor | None) -> None:
    """Step the optimizer on gradients times ``inv_divisor`` (None: as they are). With fp32 copies
    the master steps them chunk by chunk (``MasterWeights.step``) and rounds each chunk into the
    model, unless they were filled whole (``master_whole``): then step() rounds them afterwards."""
    step_fn = engine.optimizer.step
    if engine.moments is not None:
        step_fn = engine.moments.step
        engine.optimizer._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers: it stepped
    checks = engine._checks
    checks.in_engine_step = True     # the optimizer's guard (usage_checks) lets these calls through
    try:
        if engine.master is None or master_whole(engine):
            if inv_divisor is not None:
                # Every gradient the optimizer holds is fp32 here (copies filled by pull_grads).
                torch._foreach_mul_(optimizer_grads(engine), inv_divisor)
            step_fn()
        else:
            engine.master.step(engine.optimizer, step_fn, inv_divisor)
    finally:
        checks.in_engine_step = False

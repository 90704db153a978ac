"""Loss scales: none, static and dynamic, behind one protocol.

Multiplying the loss by S multiplies every gradient by S (backprop is linear), lifting small fp16
gradients above the subnormal floor (2**-24). The optimizer must see ``grad / S``; the engine folds that
division into the optimizer step. A scale too large overflows to inf: the dynamic scale skips that step
and backs off. All three kinds keep their state in device tensors and update it without a host sync::

    >>> ls = DynamicLossScale(LossScaleConfig(growth_interval=2), device="cpu")
    >>> ls.update(torch.tensor(False)); ls.update(torch.tensor(False)); float(ls.value)
    131072.0
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch

from ..fusion import FusedFunction
from ..recipe import LossScaleConfig, LossScaleKind

__all__ = ["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale", "make_loss_scale",
           "ScaleInBackward"]


class LossScale(Protocol):
    """What the engine needs from a loss scale. "Off" is a variant: NoLossScale."""

    value: torch.Tensor     # () float32 on the device: the current scale S
    steps: torch.Tensor     # () int64: update() calls so far, skipped ones included
    skipped: torch.Tensor   # () int64: of those, the steps skipped for non-finite gradients

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...
    def update(self, found_inf: torch.Tensor, skipped: bool | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _CountingScale:
    """Shared parts: the scale tensor, counts of steps and skips, state round trip."""

    def __init__(self, init: float, device: torch.device | str) -> None:
        # float32 holds every power of two the scale can take exactly.
        self.value = torch.tensor(float(init), dtype=torch.float32, device=device)
        self._steps = torch.zeros((), dtype=torch.int64, device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        # Steps and skips counted on the host, where the step's outcome is known there (a CPU, the
        # generic path): added into the tensors when they are read, so that a step costs no op here.
        self._host_steps = 0
        self._host_skipped = 0

    @property
    def steps(self) -> torch.Tensor:
        """() int64: ``update`` calls so far (the host's count folded in: the same tensor every time)."""
        if self._host_steps:
            self._steps += self._host_steps
            self._host_steps = 0
        return self._steps

    @steps.setter
    def steps(self, value: torch.Tensor) -> None:
        self._host_steps = 0
        self._steps = value

    @property
    def skipped(self) -> torch.Tensor:
        """() int64: steps skipped so far (the host's count folded in)."""
        if self._host_skipped:
            self._skipped += self._host_skipped
            self._host_skipped = 0
        return self._skipped

    @skipped.setter
    def skipped(self, value: torch.Tensor) -> None:
        self._host_skipped = 0
        self._skipped = value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (in the loss's dtype, fp32 for the losses autocast produces). No sync."""
        return loss * self.value.to(loss.dtype)

    def update(self, found_inf: torch.Tensor, skipped: bool | None = None) -> None:
        """Count the step and whether it was skipped. ``found_inf`` is a () bool tensor; ``skipped`` the
        same answer where the host already has it (the generic step synced for it), else None. No sync.
        (Counting is the whole update of a static scale or none: one call per step, not two.)"""
        if skipped is None:
            self._steps += 1
            self._skipped += found_inf  # bool into int64, in place: no cast of its own
        else:                           # known on the host: counted there, no op (see the properties)
            self._host_steps += 1
            self._host_skipped += skipped

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {"value": self.value, "steps": self.steps, "skipped": self.skipped}

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self._tensors().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = self._tensors()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"{type(self).__name__} state lacks {missing}: was it saved by a "
                             "different kind of loss scale?")
        for key, tensor in own.items():
            tensor.copy_(state[key])


class NoLossScale(_CountingScale):
    """S = 1 always. Non-finite gradients still skip the step (the engine checks them)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(1.0, device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss   # multiplying by exactly 1 would only cost a kernel


class StaticLossScale(_CountingScale):
    """A fixed S (the classic fixed loss-scale factor). An overflowing step is skipped; S never changes."""

    def __init__(self, value: float, device: torch.device | str = "cpu") -> None:
        # The config's checks (a number, finite and >= 2**-24 as fp32 holds it) guard a direct
        # StaticLossScale(1e-50) as they guard scale=static:1e-50.
        LossScaleConfig(kind=LossScaleKind.STATIC, init=value)
        super().__init__(value, device)


class DynamicLossScale(_CountingScale):
    """S adapts: grow after clean runs, back off after overflows (with hysteresis), stay in bounds.

    On an overflowing step: the step is skipped, the clean-run counter resets, and the hysteresis budget
    drops by one; when it reaches zero S is multiplied by ``backoff`` (never below ``floor``). The
    budget refills only when S grows, so after a first back-off every further overflow backs off at
    once until the scale has recovered (DeepSpeed's non-consecutive hysteresis). After
    ``growth_interval`` clean steps in a row S is multiplied by ``growth`` (never above ``ceiling``).
    At the floor the engine keeps skipping and counting: S never reaches 0 or inf and the run goes on.
    """

    def __init__(self, config: LossScaleConfig | None = None, device: torch.device | str = "cpu") -> None:
        if config is not None and not isinstance(config, LossScaleConfig):
            raise TypeError(f"DynamicLossScale takes a LossScaleConfig (e.g. LossScaleConfig(hysteresis=2)) "
                            f"or None, got {type(config).__name__}")
        self.config = config or LossScaleConfig()
        super().__init__(self.config.init, device)
        self.clean_steps = torch.zeros((), dtype=torch.int32, device=device)
        self.hysteresis_left = torch.full((), self.config.hysteresis, dtype=torch.int32, device=device)
        self.floor_skips = torch.zeros((), dtype=torch.int64, device=device)
        self._warned_floor = False
        # The general update (hysteresis above 1) compiled into one kernel on a GPU, where its ~25
        # launches cost most. With hysteresis 1 torch's own update op does it in ~8 ops on any device:
        # 6 Python calls and 72 us a step on this CPU against the compiled function's 143 and 163 us
        # (Dynamo's guards and wrappers; the H200's fp16 step made 653 calls to torch.amp's 478).
        self.fused = torch.device(device).type == "cuda" and self.config.hysteresis != 1

    def update(self, found_inf: torch.Tensor, skipped: bool | None = None) -> None:
        """Apply one step's outcome to S with a handful of tiny device ops. No host sync.

        With ``hysteresis=1`` (the default) torch's own ``_amp_update_scale_`` (GradScaler's kernel:
        back off on an overflow, grow after ``growth_interval`` clean steps) then one clamp into
        ``[floor, ceiling]`` do it in 7 ops where the general update takes about 30. Otherwise the
        general update runs, on CUDA (``fused``) as one compiled kernel (``fusion.FusedFunction``)
        instead of about 25 launches. The numbers are the same either way. ``skipped`` (the
        host's answer, where it has one) lets the floor count be kept on the host: no device op.
        """
        c = self.config
        if self.fused or c.hysteresis != 1:
            _fused_dynamic_update(self.value, self.steps, self.skipped, self.clean_steps, self.hysteresis_left,
                                  self.floor_skips, found_inf, c.growth, c.backoff, c.growth_interval,
                                  c.hysteresis, c.floor, c.ceiling, fused=self.fused)
            return
        # Steps skipped with S already at its floor (the warning's count), read before S changes.
        if skipped is None:
            self.floor_skips += found_inf & (self.value <= c.floor)
        elif skipped and float(self.value) <= c.floor:     # a skipped step: the host has synced already
            self.floor_skips += 1
        # found_inf: back off (x backoff) and restart the clean count; else count, and at the interval
        # grow (x growth) and restart. With one overflow allowed (hysteresis 1) that is the whole rule.
        torch._amp_update_scale_(self.value, self.clean_steps, found_inf.to(torch.float32),
                                 c.growth, c.backoff, c.growth_interval)
        # Powers of two times powers of two stay exact in fp32; the clamp keeps S in [floor, ceiling].
        self.value.clamp_(c.floor, c.ceiling)
        _CountingScale.update(self, found_inf, skipped)     # the step and skip counts

    def warn_if_at_floor(self) -> None:
        """Warn once if steps were skipped with S already at its floor. Syncs with the host."""
        if not self._warned_floor and int(self.floor_skips) > 0:
            self._warned_floor = True
            warnings.warn(
                f"loss scale is at its floor ({self.config.floor:g}) and steps still overflow "
                f"({int(self.floor_skips)} skipped there so far): the overflow is not a scaling "
                "problem; look for inf/NaN in the forward pass or lower the learning rate",
                RuntimeWarning, stacklevel=3)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return super()._tensors() | {"clean_steps": self.clean_steps,
                                     "hysteresis_left": self.hysteresis_left,
                                     "floor_skips": self.floor_skips}


def _dynamic_update(value: torch.Tensor, steps: torch.Tensor, skipped: torch.Tensor, clean_steps: torch.Tensor,
                    hysteresis_left: torch.Tensor, floor_skips: torch.Tensor, found_inf: torch.Tensor,
                    growth: float, backoff: float, interval: int, hysteresis: int, floor: float,
                    ceiling: float) -> None:
    """DynamicLossScale's update on its state tensors, in place (see the class docstring)."""
    steps += 1
    skipped += found_inf.to(torch.int64)
    clean = ~found_inf
    floor_skips += (found_inf & (value <= floor)).to(torch.int64)
    clean_steps.copy_(torch.where(clean, clean_steps + 1, 0))
    grow = clean & (clean_steps >= interval)
    budget = torch.where(found_inf, (hysteresis_left - 1).clamp(min=0), hysteresis_left)
    back_off = found_inf & (budget <= 0)
    # Powers of two times powers of two stay exact in fp32; the clamps keep S in [floor, ceiling].
    new_value = torch.where(grow, (value * growth).clamp(max=ceiling), value)
    new_value = torch.where(back_off, (value * backoff).clamp(min=floor), new_value)
    value.copy_(new_value)
    clean_steps.copy_(torch.where(grow, 0, clean_steps))
    hysteresis_left.copy_(torch.where(grow, hysteresis, budget))


_fused_dynamic_update = FusedFunction(_dynamic_update, "loss-scale update")


def make_loss_scale(config: LossScaleConfig, device: torch.device | str) -> LossScale:
    """The loss scale a recipe's config describes, with its state on ``device``."""
    if config.kind == "none":
        return NoLossScale(device)
    if config.kind == "static":
        return StaticLossScale(config.init, device)
    if config.kind == "per-layer":
        from .per_layer import LayerLossScale    # it builds on DynamicLossScale: imported here, not above
        return LayerLossScale(config, device)     # the engine attaches it to the model (its hooks)
    return DynamicLossScale(config, device)


class ScaleInBackward(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the loss scale ``S``.

    For a trainer that logs the loss it gets back and runs ``backward`` on it itself (Hugging Face's
    Trainer): the loss stays unscaled, the gradients come out ``S``-scaled, as ``(loss * S).backward()``.
    """

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        # S is a power of two (dynamic scaling) or the user's static value: one exact multiply or one
        # rounding in fp32, as (loss * S).backward() would do.
        return grad * scale.to(grad.dtype), None

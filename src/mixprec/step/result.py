"""What one ``MixedPrecision.step()`` reports (:class:`StepResult`) and what may watch every step
(:class:`StepObserver`, e.g. the doctor's range collector). Both are re-exported by ``engine``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..engine import MixedPrecision

__all__ = ["StepObserver", "StepResult", "check_step_observer"]


class StepObserver(Protocol):
    """What ``MixedPrecision.add_step_observer`` calls in every step (e.g. the doctor's RangeCollector)."""

    def before_step(self, engine: MixedPrecision) -> None:
        """Gradients gathered (fp32 copies filled) and still multiplied by ``engine.loss_scale.value``."""

    def after_step(self, engine: MixedPrecision, found_inf: torch.Tensor) -> None:
        """The optimizer stepped or skipped (``found_inf``, a () bool tensor, says which); fp32 copies
        are not yet rounded into the model."""


def check_step_observer(observer: object) -> None:
    """The TypeError ``add_step_observer`` raises for an object without the protocol's two methods."""
    missing = [m for m in ("before_step", "after_step") if not callable(getattr(observer, m, None))]
    if missing:
        raise TypeError(f"a step observer needs methods before_step(engine) and after_step(engine, "
                        f"found_inf); {type(observer).__name__} has no {' or '.join(missing)} (see "
                        "mixprec.StepObserver; mixprec.diagnostics.RangeCollector is one)")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did. Fields are device tensors; the properties read them (each a host sync)."""

    skipped_t: torch.Tensor     # () bool: the step was skipped (non-finite gradients)
    scale_t: torch.Tensor       # () float32: the loss scale after this step's update
    grad_norm_t: torch.Tensor   # () float32: global L2 norm of the unscaled gradients, before clipping

    @property
    def skipped(self) -> bool:
        return bool(self.skipped_t)

    @property
    def scale(self) -> float:
        return float(self.scale_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t)

    def __repr__(self) -> str:
        return f"StepResult(skipped={self.skipped}, scale={self.scale:g}, grad_norm={self.grad_norm:.6g})"

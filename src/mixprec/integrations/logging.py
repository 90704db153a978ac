"""``MetricsLogger``: what mixed precision is doing, step by step, in TensorBoard or any logger.

One object, fed from any loop: your own (``log_step`` after ``mp.step()``), Lightning's
(``MixedPrecisionPlugin(metrics=...)``) or the doctor's range collection (``log_ranges``). It writes
to a ``torch.utils.tensorboard.SummaryWriter`` (anything with ``add_scalar(tag, value, step)``) or to
a function ``sink(metrics: dict[str, float], step: int)`` (print, W&B's ``wandb.log``-alikes, a list)::

    writer = SummaryWriter("runs/fp16")
    metrics = MetricsLogger(writer)
    ...
    result = mp.step()
    metrics.log_step(mp, result, step)

Per step: ``mixprec/loss_scale`` (after the step's update), ``mixprec/skipped`` (1.0 if the step was
skipped), ``mixprec/skipped_steps`` (total so far) and ``mixprec/grad_norm`` (the unscaled global
norm, before clipping). From a ``RangesResult`` (``diagnostics.range_collector``), per layer and kind of tensor:
``mixprec/ranges/<layer>/<kind>/underflow`` and ``.../overflow``, the fractions of values a format
would flush to zero or saturate.

``every=k`` logs every k-th call only. Each logged step reads its numbers from the device (a host
sync): log every step only when that is cheap against the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MetricsLogger"]


class MetricsLogger:
    """Send loss scale, skips, grad norm and range fractions to ``sink`` (see the module docstring)."""

    def __init__(self, sink: Any, *, every: int = 1, prefix: str = "mixprec/") -> None:
        if not (hasattr(sink, "add_scalar") or callable(sink)):
            raise TypeError(f"sink must have add_scalar(tag, value, step) (a SummaryWriter) or be a function "
                            f"sink(metrics, step); got {type(sink).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.sink, self.every, self.prefix = sink, every, prefix
        self._calls = 0

    def log_step(self, engine: Any, result: Any, step: int | None = None) -> dict[str, float] | None:
        """Log one ``StepResult`` of ``engine``; returns what was logged (None on a step not logged)."""
        self._calls += 1
        if (self._calls - 1) % self.every:
            return None
        step = self._calls - 1 if step is None else step
        metrics = {"loss_scale": result.scale, "skipped": float(result.skipped),
                   "skipped_steps": float(engine.skipped_steps), "grad_norm": result.grad_norm}
        self._write(metrics, step)
        return metrics

    def log_ranges(self, ranges: Any, step: int, fmt: str = "fp16") -> dict[str, float]:
        """Log per-layer underflow (flush to zero) and overflow fractions of ``fmt`` from a RangesResult."""
        metrics = {}
        for module in ranges.modules:
            for kind, stats in module.stats.items():
                metrics[f"ranges/{module.name}/{kind}/underflow"] = stats.fraction(fmt, "flush")
                metrics[f"ranges/{module.name}/{kind}/overflow"] = stats.fraction(fmt, "overflow")
        self._write(metrics, step)
        return metrics

    def _write(self, metrics: dict[str, float], step: int) -> None:
        tagged = {self.prefix + k: float(v) for k, v in metrics.items()}
        if hasattr(self.sink, "add_scalar"):
            for tag, value in tagged.items():
                self.sink.add_scalar(tag, value, step)
        else:
            sink: Callable[[dict[str, float], int], Any] = self.sink
            sink(tagged, step)

"""Catching the training-loop mistakes that give a wrong result without an error.

Each of these trains on, silently wrong, without a check:

- the forward ran outside ``mp.autocast()``: an fp16/bf16/fp8 recipe quietly computes in fp32;
- ``loss.backward()`` instead of ``mp.backward(loss)`` under a loss scale: the gradients are not
  multiplied by S, but ``step()`` still divides by S (65536 for fp16), so training stalls;
- ``step()`` twice without a new backward: the same (stale) gradients are applied twice;
- every step skipped for inf/NaN gradients: nothing moves and, without a dynamic scale at its floor,
  nothing says so.

The checks cost no host-device sync: the first three read Python-side flags and the gradients'
version counters (host metadata, bumped by every in-place write such as backward's accumulation);
the skip watch keeps a device counter of consecutive skips and reads it only where reading is free
(a CPU tensor, a count the generic step already synced for, or a non-blocking copy that has landed).
Under ``torch.compile`` the checks that read version counters are left out (they would break the
graph); the flags still work.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

__all__ = ["UsageChecks", "SKIP_WARNING_AFTER"]

# Consecutive skipped steps before the warning. A dynamic fp16 scale skips a few steps while it
# settles (each halves S); ten in a row means S fell 1024-fold or there is no scale to adjust.
SKIP_WARNING_AFTER = 10


def _compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)   # torch >= 2.3
    return bool(is_compiling and is_compiling())


class UsageChecks:
    """The engine's misuse checks, kept out of ``step()`` so the step reads top to bottom."""

    def __init__(self, recipe: Any, scaled: bool, device: torch.device) -> None:
        # fp16/bf16 autocast or fp8 layers: forgetting mp.autocast() changes what is computed.
        self.needs_autocast = recipe.autocast or recipe.fp8 is not None
        # What running outside autocast means: fp32 compute, or (pure recipes: 16-bit weights) no op lists.
        self.outside = (f"without autocast's op lists (ops that need fp32, such as softmax and losses, ran "
                        f"in {recipe.param.value})" if recipe.param.is_low else
                        "in fp32, not in the recipe's precision")
        self.scaled = scaled            # a loss scale S != 1 is in force (static or dynamic)
        self.entered_autocast = False   # mp.autocast() entered since the last step()
        self.via_engine = False         # mp.backward() called since the last step()
        self.warned_autocast = False
        self.stepped_grads: list[tuple[Any, int]] | None = None   # (weakref, version) after a step
        self.skip_run = torch.zeros((), dtype=torch.int64, device=device)   # consecutive skips
        self.skip_run_py = 0            # the same count where the step already knows it on the host
        self._pending: tuple[torch.Tensor, Any] | None = None   # CUDA: copy in flight, its event
        self._host: torch.Tensor | None = None                      # its pinned destination
        self.traced = False             # the engine traces inf/NaN (trace_nonfinite=True)
        self.warned_skips = False

    # ------------------------------------------------------------- forward and backward
    def on_backward(self) -> None:
        """mp.backward() was called; warn once if the forward ran outside mp.autocast()."""
        self.via_engine = True
        if self.needs_autocast and not self.entered_autocast and not self.warned_autocast:
            self.warned_autocast = True
            warnings.warn(
                "mp.backward() was called but mp.autocast() was not entered since the last step: the "
                f"forward ran {self.outside}. Run the forward inside `with mp.autocast():`",
                UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ before the step
    def check_before_step(self, model_grads: list[torch.Tensor]) -> None:
        """Refuse a step whose gradients did not come from a new mp.backward(). Changes nothing."""
        if self.via_engine:
            return
        if not _compiling() and self._same_grads_as_last_step(model_grads):
            raise RuntimeError(
                "step() was called again without a new backward: these gradients were already applied "
                "by the last step. Call mp.zero_grad(), then mp.backward(loss), once per step()")
        if self.scaled:
            raise RuntimeError(
                "step() found gradients that did not come from mp.backward(loss): under a loss scale "
                "step() divides them by S, so loss.backward() would leave them S times too small. "
                "Call mp.backward(loss) instead of loss.backward()")

    def _same_grads_as_last_step(self, grads: list[torch.Tensor]) -> bool:
        # The same tensor objects with the same version counters: no backward wrote to them since.
        if self.stepped_grads is None or len(grads) != len(self.stepped_grads):
            return False
        return all(ref() is g and g._version == version
                   for (ref, version), g in zip(self.stepped_grads, grads))

    # ------------------------------------------------------------------- after the step
    def after_step(self, model_grads: list[torch.Tensor], found_inf: torch.Tensor,
                   stepped: bool | None) -> None:
        """Reset the per-step flags, remember the gradients, count consecutive skips.

        ``stepped`` is the host's answer where the step already synced for it (generic path), else
        None: then a device counter is kept and read only when that read is free.
        """
        self.entered_autocast = self.via_engine = False
        if not _compiling():
            self.stepped_grads = [(weakref.ref(g), g._version) for g in model_grads]
        if self.warned_skips:
            return
        if stepped is not None:
            self.skip_run_py = 0 if stepped else self.skip_run_py + 1
            run = self.skip_run_py
        else:
            # run = run + 1 if skipped else 0: one tiny device op, no sync.
            self.skip_run.copy_(torch.where(found_inf, self.skip_run + 1, 0))
            run = self._read_run_if_free()
        if run is not None and run >= SKIP_WARNING_AFTER:
            self.warned_skips = True
            self.warn_skips(run)

    def _read_run_if_free(self) -> int | None:
        if self.skip_run.device.type == "cpu":
            return int(self.skip_run)      # a CPU tensor: reading it waits on nothing
        if not torch.cuda.is_available() or self.skip_run.device.type != "cuda":
            return None
        # A copy issued at an earlier step is read once its event reports done (query never blocks).
        run = None
        if self._pending is not None and self._pending[1].query():
            run = int(self._pending[0])
            self._pending = None
        if self._pending is None:
            if self._host is None:
                self._host = torch.empty((), dtype=torch.int64, pin_memory=True)
            self._host.copy_(self.skip_run, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (self._host, event)
        return run

    def warn_skips(self, run: int) -> None:
        warnings.warn(
            f"{run} steps in a row were skipped for inf/NaN gradients: the weights have not changed "
            "since. A loss scale cannot fix a NaN from the forward (a log of 0, a division by zero, "
            "a too-high learning rate). " + ("mp.last_overflow names" if self.traced else
            "Build MixedPrecision(..., trace_nonfinite=True) and read mp.last_overflow to see") +
            " the module and op where the first inf/NaN appeared",
            RuntimeWarning, stacklevel=4)

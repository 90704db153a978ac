"""The fp32 copies rounded back into the 16-bit weights: nearest, stochastic (bf16-sr) or Kahan's split.

Under ``keep=True`` one ``torch._foreach_copy_`` rounds the masters to nearest even into the model. Without
a master the step's flat fp32 buffer is rounded in place, stochastically (``stochastic_round_bf16_``) or
into bf16 and a compensation (``kahan.KahanCompensation.split_``), and its bf16 high halves are copied
into the model in one call; the transient copies are released after.

The stochastic rounding's noise (``stochastic_rounding.RoundingNoise``) is a function of the seed,
the number of steps taken and the element's position: not of the chunking (a chunked step rounds bitwise as the one-call
step), not of the device (integer arithmetic), and not of skipped steps (the count of steps taken
advances on the device by ``1 - found_inf``, no host sync), so a run that skipped a bad step rounds
the rest of its steps exactly as one that never saw it. That holds in ``step``, which reads the flag
the engine hands a fused optimizer; ``push_weights`` (the copies filled whole, for step observers or
a compiled step) counts every call as a step taken unless it is handed ``found_inf`` too.

``Writeback`` is a part of ``master.MasterWeights`` (it rounds the copies that class builds).
"""

from __future__ import annotations

import torch

from .stochastic_rounding import run_fill_plan, stochastic_round_bf16_
from .transients import _views, _without_grad

__all__ = ["Writeback"]


class Writeback:
    """``MasterWeights``'s rounding of the fp32 copies into the model, and bf16-sr's noise for it."""

    @torch.no_grad()
    def push_weights(self, which: list[int] | None = None, *, found_inf: torch.Tensor | None = None) -> None:
        """Round the fp32 copies into the model's weights (nearest, or stochastic for bf16-sr).

        Rounding an unchanged copy gives back the model's weight bit for bit, whatever the noise, so
        this is safe to run after a step the optimizer skipped on the device. ``which`` picks copies
        by position (default: all); one call rounds one step. ``found_inf``: the flag the optimizer's
        kernel skipped on, if it did so on the device; then a skipped step does not count as taken
        for the rounding noise (without it every call counts).
        """
        which = self._order if which is None else list(which)
        if which:
            tables = self.generator.tables() if self.generator is not None else None
            # Fresh scratch: the copies' gradients stay intact for whoever still holds them.
            scratch = torch.empty(sum([self._numel[i] for i in which]), dtype=torch.int32,
                                  device=self.device) if self.generator is not None else None
            self._round_into_model(which, tables, scratch)
        if self.generator is not None:
            self.generator.advance(found_inf)

    @_without_grad
    def _round_into_model(self, which: list[int], tables, scratch: torch.Tensor | None) -> None:
        """Round copies ``which`` into the model: one pass per chunk. Transient ones are released."""
        if not which:
            return
        targets = [self.model_params[i].data for i in which]
        if self.generator is None and self.kahan is None:
            torch._foreach_copy_(targets, [self.masters[i] for i in which])   # round to nearest even
        else:
            flat = self._pulled_weights(which)
            layout = self._layout
            # A small model's kept buffer, all of it: its bit views, the noise's xors and the rounded
            # weights' views are made once, not at every step.
            kept = layout is not None and flat is layout.weights_flat and which is self._order
            if self.kahan is not None:     # nearest (ties away), the rest kept as compensations
                rounded = self.kahan.split_(flat, self._runs(which), layout.bits if kept else None)
            else:
                kept = kept and scratch is layout.scratch
                run_fill_plan(self._noise_xors(which, tables, scratch, kept))
                rounded = stochastic_round_bf16_(flat, scratch, layout.bits if kept else None)
            torch._foreach_copy_(targets, self._rounded_as(rounded, targets, kept))   # bf16 high halves
        if not self.keep:
            self._release(which)

    def _noise_xors(self, which: list[int], tables, scratch: torch.Tensor, kept: bool) -> list:
        """bf16-sr's noise for copies ``which`` into ``scratch`` as xors (``RoundingNoise.fill_plan``);
        for the kept layout (``kept``) laid out once per ``tables`` (eager steps: always the same)."""
        plan = self._noise_plan
        if kept and plan is not None and plan[0] is tables:
            return plan[1]
        xors = [x for offset, start, length in self._runs(which)
                for x in self.generator.fill_plan(scratch[offset:offset + length], start, tables)]
        if kept:
            self._noise_plan = (tables, xors)
        return xors

    def _rounded_as(self, rounded: torch.Tensor, targets: list[torch.Tensor], kept: bool) -> list[torch.Tensor]:
        """``rounded`` (a strided bf16 view) as tensors shaped like ``targets``: made once for the kept
        layout (``kept``: ``rounded`` is its weight half's high halves, the same view at every step),
        afresh otherwise."""
        if not kept:
            return _views(rounded, targets)
        if self._rounded_views is None:
            self._rounded_views = _views(rounded, targets)
        return self._rounded_views

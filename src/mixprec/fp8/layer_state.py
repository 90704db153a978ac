"""The scale state and casts every fp8 layer shares: ``Fp8Linear`` (an ``nn.Linear``, linear.py) and
``Fp8GroupedLinear`` (a mixture of experts' grouped GEMM over a 3-D weight, grouped.py).

Per role (``ROLES``: the input and weight in e4m3, the output gradient in e5m2) a layer keeps, in
non-persistent buffers, the scale of its last training cast, that tensor's amax, the amax history
(delayed scaling) and the range counts; blocked scalings keep the amaxes and counts, and nvfp4 its
noise seed, backward count and Hadamard signs. ``_cast`` reads the state and changes nothing; the
layer's backward enters each cast with ``_record`` (once per real forward). ``fp8_state()`` hands the
state out, ``load_fp8_state()`` restores it bit for bit (fp8/state.py does it for a whole model), and
``fp8/stats.py`` reads it for the doctor.

    >>> {role: fmt.name for role, fmt in ROLES.items()}
    {'input': 'fp8_e4m3', 'weight': 'fp8_e4m3', 'grad_output': 'fp8_e5m2'}
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..formats import FP8_E4M3, FP8_E5M2, Format, quantize
from ..recipe.fp8 import Fp8Config
from .blocked_linear import BlockedRecipe, blocked_recipe, rht_signs
from .fused import fused_cast
from .matmul import emulated_mm, scaled_mm
from .scaling import amax_f32, cast_to_fp8, current_scale, delayed_scale, quantize_fp8, record_amax

__all__ = ["Fp8LayerState", "ROLES"]

# The three tensors an fp8 layer scales, and their formats.
ROLES: dict[str, Format] = {"input": FP8_E4M3, "weight": FP8_E4M3, "grad_output": FP8_E5M2}


class Fp8LayerState(nn.Module):
    """The fp8 scale state and casts of one layer (a base class: it defines no ``__init__`` and no
    forward). ``_setup_fp8(config, backend, device)`` makes the buffers; subclasses call it once."""

    fp8_config: Fp8Config
    backend: str                      # "scaled_mm" or "emulate"
    count_ranges: bool
    blocked: BlockedRecipe | None

    def _setup_fp8(self, config: Fp8Config, backend: str, device: torch.device) -> None:
        if backend not in ("scaled_mm", "emulate"):
            raise ValueError(f"fp8 layer backend must be 'scaled_mm' or 'emulate', got {backend!r}")
        self.fp8_config, self.backend = config, backend
        self.count_ranges = False   # set by fp8.stats.count_fp8_ranges: exact per-cast counts
        self.blocked: BlockedRecipe | None = None
        if config.blocked:
            self.blocked = blocked_recipe(config)
            self._setup_blocked(self.blocked, device)
            return
        # Eager casts through fp8/fused.py's compiled kernel: off by default everywhere. Measured on an
        # H200 (torch 2.11, 2026-11-28, benchmarks/fp8/bench_fp8_cast.py) the compiled cast lost from
        # 1024x1024 up, 10x at 4096x4096 and 23x at 8192x8192 (its dynamic-shape kernels), and won by
        # about 60 us only on tensors of 256x256 and less, where a step waits on the host anyway.
        # ``layer.fused_casts = True`` turns it on per layer; the numbers are the same bits.
        self.fused_casts = False
        for role in ROLES:
            # Non-persistent: model.state_dict() stays nn.Linear's; the engine saves these itself.
            self.register_buffer(f"{role}_scale", torch.ones((), device=device), persistent=False)
            self.register_buffer(f"{role}_amax", torch.zeros((), device=device), persistent=False)
            # [values flushed to zero, values saturated, values cast], summed while count_ranges is on.
            self.register_buffer(f"{role}_counts", torch.zeros(3, dtype=torch.int64, device=device),
                                 persistent=False)
            if config.delayed:
                self.register_buffer(f"{role}_history", torch.zeros(config.history, device=device),
                                     persistent=False)

    def _setup_blocked(self, how: BlockedRecipe, device: torch.device) -> None:
        """Blocked scaling's state: per role the last amax and the range counts (fp8/stats.py and the
        doctor read them; a per-tensor scale does not apply); nvfp4's noise seed, backward count, signs."""
        self.fused_casts = False
        for role in ROLES:
            self.register_buffer(f"{role}_amax", torch.zeros((), device=device), persistent=False)
            self.register_buffer(f"{role}_counts", torch.zeros(3, dtype=torch.int64, device=device),
                                 persistent=False)
        if how.sr:
            # The stochastic rounding's noise is a hash of (seed, backwards taken, position): the two
            # int64 are its whole state, so a resumed run rounds as the uninterrupted one.
            self.register_buffer("sr_seed", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
            self.register_buffer("sr_steps", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        if how.rht:
            self.register_buffer("rht_signs", rht_signs(0).to(device), persistent=False)

    def reseed(self, seed: int) -> None:
        """Set nvfp4's per-layer randomness from ``seed`` (the swap passes a hash of the layer's name):
        the stochastic-rounding noise and the Hadamard signs. A no-op for other scalings."""
        if hasattr(self, "sr_seed"):
            self.sr_seed.fill_(seed % 2**32)
        if hasattr(self, "rht_signs"):
            self.rht_signs.copy_(rht_signs(seed))

    def fp8_formats(self) -> dict[str, Format]:
        """The element format of each role: ``ROLES`` per tensor; the blocked recipe's otherwise."""
        return self.blocked.formats if self.blocked is not None else dict(ROLES)

    def _record_blocked(self, role: str, amax: torch.Tensor, counts: torch.Tensor | None) -> None:
        """Enter one blocked cast: its tensor's amax, and its range counts when counted."""
        getattr(self, f"{role}_amax").copy_(amax)
        if counts is not None:
            getattr(self, f"{role}_counts").add_(counts)

    # ------------------------------------------------------------------------------- numerics
    def _record(self, role: str, scale: torch.Tensor, amax: torch.Tensor, counts: torch.Tensor | None,
                *more: Any) -> None:
        """Enter casts into the scale state: amax history (delayed), last scale and amax, counts.

        ``more``: further ``(role, scale, amax, counts)`` groups, flattened, entered alike; the last
        scales and amaxes of all of them are copied in one multi-tensor op (a layer's backward enters
        its three casts so: one launch instead of six, and a dozen Python calls fewer)."""
        buffers = self._buffers
        delayed = self.fp8_config.delayed
        targets, values = [], []
        entries = (role, scale, amax, counts) + more
        for i in range(0, len(entries), 4):
            role, scale, amax, counts = entries[i:i + 4]
            if delayed:
                record_amax(buffers[f"{role}_history"], amax)
            targets += [buffers[f"{role}_scale"], buffers[f"{role}_amax"]]
            values += [scale, amax]
            if counts is not None:
                buffers[f"{role}_counts"].add_(counts)
        torch._foreach_copy_(targets, values)

    def _cast(self, role: str, x: torch.Tensor, record: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(fp8 values of x * scale, scale, amax, range counts or None)``; the values are float8
        tensors, or fp32 ones when emulating. Nothing is recorded here (``_record`` does that)."""
        fmt, cfg = ROLES[role], self.fp8_config
        # The scale for casting x now: read from the scale state, which nothing here changes.
        amax = amax_f32(x)
        if cfg.delayed:
            buffers = self._buffers
            scale = delayed_scale(buffers[f"{role}_history"], amax, buffers[f"{role}_scale"], fmt,
                                  algo=cfg.amax, margin=cfg.margin, pow2=cfg.pow2)
        else:
            scale = current_scale(amax, fmt, margin=cfg.margin, pow2=cfg.pow2)
        counts = None
        if record and self.count_ranges:
            y = x.detach().to(torch.float32) * scale
            mag = y.abs()
            # |y| <= min_subnormal / 2 rounds to 0 (the tie goes to the even 0). Saturated: finite values
            # that would round above max without the clamp (e4m3's 448 < y <= 464 still round to 448).
            flushed = ((mag <= fmt.min_subnormal / 2) & (y != 0)).sum()
            rounded = quantize(y, fmt, saturate=False)
            saturated = (torch.isfinite(y) & ~(rounded.abs() <= fmt.max)).sum()
            counts = torch.stack([flushed, saturated, torch.tensor(y.numel(), device=y.device)])
        cast = cast_to_fp8 if self.backend == "scaled_mm" else quantize_fp8
        return cast(x, scale, fmt), scale, amax, counts

    def _cast_pair(self, role: str, x: torch.Tensor, record: bool, want_t: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q, q^T or None, scale, amax, counts or None)``: ``_cast`` plus, where the cast made it, a
        contiguous transpose for backward to multiply by.

        Fused (``fused_casts``, eager, no range counting): one compiled kernel writes ``q`` and a
        contiguous ``q^T``. Otherwise there is none (None) and ``scaled_mm`` makes the layout it needs
        from ``q`` (a view of a view would be two ops a role and a step for nothing).
        Inside a model the user compiles, the plain functions are traced and Inductor fuses them.
        Neither records: the caller enters the cast into the scale state with ``_record``.
        """
        if self.fused_casts and not self.count_ranges and not torch.compiler.is_compiling():
            cfg = self.fp8_config
            history = getattr(self, f"{role}_history") if cfg.delayed else None
            # detach(): a plain tensor, so one dynamic-shape graph serves weights (Parameters get
            # static shapes in torch.compile: a recompile per weight shape) and activations alike.
            q, q_t, scale, amax = fused_cast(x.detach(), getattr(self, f"{role}_scale"),
                                             getattr(self, f"{role}_amax"), history, ROLES[role],
                                             algo=cfg.amax, margin=cfg.margin, pow2=cfg.pow2,
                                             record=False, want_t=want_t)
            return q, q_t, scale, amax, None
        q, scale, amax, counts = self._cast(role, x, record)
        return q, None, scale, amax, counts

    def _mm(self, a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
        mm = scaled_mm if self.backend == "scaled_mm" else emulated_mm
        return mm(a, b, inv_a, inv_b, out_dtype)

    # ---------------------------------------------------------------------------------- state
    def fp8_state(self) -> dict[str, torch.Tensor]:
        """Copies of the scale state: per role its scale, last amax, history (delayed) and counts."""
        return {name: buf.detach().clone() for name, buf in self.named_buffers(recurse=False)}

    def load_fp8_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``fp8_state()``'s output bit for bit; a missing or misshapen entry is a ValueError."""
        mine = self.fp8_state()
        if set(state) != set(mine):
            raise ValueError(f"fp8 state has entries {sorted(state)}, this layer needs {sorted(mine)}: "
                             "was it saved under another fp8 recipe (history length, scaling)?")
        for name, value in state.items():
            buf = getattr(self, name)
            if value.shape != buf.shape:
                raise ValueError(f"fp8 state {name!r} has shape {tuple(value.shape)}, this layer needs "
                                 f"{tuple(buf.shape)}")
            buf.copy_(value)


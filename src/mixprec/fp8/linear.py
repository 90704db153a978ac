"""``Fp8Linear``: an ``nn.Linear`` whose three matmuls run in fp8 with per-tensor scales.

Forward ``y = x W^T + b``: ``x`` and ``W`` are cast to e4m3 (3 mantissa bits, max 448), each with its
own fp32 scale, multiplied with fp32 accumulation and rounded once to the output dtype (the autocast
dtype, e.g. bf16, or x's dtype without autocast); the bias is added in that dtype. Backward: the
output gradient ``g`` is cast to e5m2 (2 mantissa bits, max 57344: gradients need range more than
precision), and

    grad_x = g @ W         e5m2 (M, N) x e4m3 (N, K), scales 1/s_g and 1/s_w, in x's dtype
    grad_W = g^T @ x       e5m2 (N, M) x e4m3 (M, K), scales 1/s_g and 1/s_x, in W's dtype

reusing the fp8 ``x`` and ``W`` saved by the forward (1 byte per element instead of 2 or 4). The
layer shares its ``weight`` and ``bias`` Parameters with the ``nn.Linear`` it replaces, so optimizers
built before the swap keep working, and ``state_dict()`` keys are those of ``nn.Linear``. Scale state
(scales, last amaxes, amax histories) lives in non-persistent buffers; ``fp8_state()`` hands it out
(the engine puts it in its own state_dict and in checkpoints).

    >>> layer = Fp8Linear.from_linear(nn.Linear(32, 16), Fp8Config(), backend="emulate")
    >>> layer(torch.randn(4, 32)).shape
    torch.Size([4, 16])

Blocked scalings (``fp8=rowwise | block | mxfp8 | nvfp4``: one scale per block of each GEMM operand)
run in the same layer through ``fp8/blocked_linear.py``'s autograd function; their state is the last
amax and the range counts per role (there is no per-tensor scale to keep), and for nvfp4 the
stochastic-rounding seed and backward count and the random Hadamard signs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..formats import FP8_E4M3, FP8_E5M2, Format, quantize
from ..recipe.fp8 import Fp8Config
from .blocked_linear import BlockedLinearFn, BlockedRecipe, blocked_recipe, rht_signs
from .fused import fused_cast
from .matmul import emulated_mm, scaled_mm
from .scaling import amax_f32, cast_to_fp8, current_scale, delayed_scale, quantize_fp8, record_amax

__all__ = ["Fp8Linear", "ROLES"]

# The three tensors an fp8 linear scales, and their formats.
ROLES: dict[str, Format] = {"input": FP8_E4M3, "weight": FP8_E4M3, "grad_output": FP8_E5M2}


class _Fp8LinearFn(torch.autograd.Function):
    """``x2d @ W^T`` in fp8; the layer object carries the scale state. Autocast is off inside."""

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, layer: Fp8Linear,
                out_dtype: torch.dtype, record: bool) -> torch.Tensor:
        # x_t and w_t are what backward multiplies by, transposed: (K, M) and (K, N), row-major when
        # the fused cast wrote them (views of x_q and w_q otherwise; scaled_mm copies them then).
        x_q, x_t, s_x, a_x, c_x = layer._cast_pair("input", x2d, record, ctx.needs_input_grad[1])    # (M, K)
        w_q, w_t, s_w, a_w, c_w = layer._cast_pair("weight", weight, record, ctx.needs_input_grad[0])  # (N, K)
        # Reciprocals undo the scales after the matmul; exact when the scales are powers of two.
        inv_x, inv_w = s_x.reciprocal(), s_w.reciprocal()
        out = layer._mm(x_q, w_q.t(), inv_x, inv_w, out_dtype)     # (M, N)
        # Keep only what backward will use: the fp8 x for the weight gradient, the fp8 W for the input
        # gradient (a first layer fed with data needs no input gradient, so no copy of W is kept).
        ctx.save_for_backward(x_t if ctx.needs_input_grad[1] else None,
                              w_t if ctx.needs_input_grad[0] else None, inv_x, inv_w,
                              s_x, a_x, c_x, s_w, a_w, c_w)
        ctx.layer, ctx.x_dtype, ctx.w_dtype, ctx.record = layer, x2d.dtype, weight.dtype, record
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_t, w_t, inv_x, inv_w, s_x, a_x, c_x, s_w, a_w, c_w = ctx.saved_tensors
        layer = ctx.layer
        if ctx.record:
            # The forward's casts enter the scale state here, once per real forward: under activation
            # checkpointing the forward runs twice (the recompute with grad enabled) but this backward
            # once, and the recompute, seeing the history unchanged, casts exactly as the forward did.
            layer._record("input", s_x, a_x, c_x)
            layer._record("weight", s_w, a_w, c_w)
        with torch.autocast(grad_out.device.type, enabled=False):
            g_q, g_t, s_g, a_g, c_g = layer._cast_pair("grad_output", grad_out, True, ctx.needs_input_grad[1])
            layer._record("grad_output", s_g, a_g, c_g)
            inv_g = s_g.reciprocal()                                  # g_q (M, N) e5m2, g_t (N, M)
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:
                grad_x = layer._mm(g_q, w_t.t(), inv_g, inv_w, ctx.x_dtype)     # (M,N)@(N,K)
            if ctx.needs_input_grad[1]:
                grad_w = layer._mm(g_t, x_t.t(), inv_g, inv_x, ctx.w_dtype)     # (N,M)@(M,K)
        return grad_x, grad_w, None, None, None


class Fp8Linear(nn.Linear):
    """A linear layer computing in fp8 (e4m3 forward, e5m2 output gradient), per-tensor scaled.

    ``config`` says how scales are found (current or delayed); ``backend`` is ``"scaled_mm"``
    (``torch._scaled_mm`` on float8 tensors) or ``"emulate"`` (the same quantization through
    ``formats.quantize`` and an fp32 matmul). Scale state changes only in backward: a forward in
    training mode with grad enabled enters its input and weight casts there, with the output
    gradient's. So evaluation leaves it untouched, and under ``torch.utils.checkpoint`` (reentrant or
    not) each real forward is recorded once and its recompute casts bit for bit as it did. No host syncs.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 config: Fp8Config | None = None, backend: str = "emulate",
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup_fp8(config or Fp8Config(), backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config, backend: str) -> Fp8Linear:
        """An Fp8Linear holding ``linear``'s very Parameters (no copy: optimizers keep their references)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        layer.train(linear.training)
        layer._setup_fp8(config, backend)
        return layer

    def _setup_fp8(self, config: Fp8Config, backend: str) -> None:
        if backend not in ("scaled_mm", "emulate"):
            raise ValueError(f"Fp8Linear backend must be 'scaled_mm' or 'emulate', got {backend!r}")
        self.fp8_config, self.backend = config, backend
        self.count_ranges = False   # set by fp8.stats.count_fp8_ranges: exact per-cast counts
        self.blocked: BlockedRecipe | None = None
        if config.blocked:
            self.blocked = blocked_recipe(config)
            self._setup_blocked(self.blocked)
            return
        # Eager casts through fp8/fused.py's compiled kernel (one read, one write per role): on by
        # default on CUDA with torch._scaled_mm; on CPU compiling costs more than it saves.
        self.fused_casts = backend == "scaled_mm" and self.weight.device.type == "cuda"
        device = self.weight.device
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

    def _setup_blocked(self, how: BlockedRecipe) -> None:
        """Blocked scaling's state: per role the last amax and the range counts (fp8/stats.py and the
        doctor read them; a per-tensor scale does not apply); nvfp4's noise seed, backward count, signs."""
        self.fused_casts = False
        device = self.weight.device
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
    def _scale(self, role: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, amax)`` for casting ``x`` now; reads the scale state, changes nothing."""
        cfg, fmt = self.fp8_config, ROLES[role]
        amax = amax_f32(x)
        if cfg.delayed:
            history = getattr(self, f"{role}_history")
            scale = delayed_scale(history, amax, getattr(self, f"{role}_scale"), fmt, algo=cfg.amax,
                                  margin=cfg.margin, pow2=cfg.pow2)
        else:
            scale = current_scale(amax, fmt, margin=cfg.margin, pow2=cfg.pow2)
        return scale, amax

    def _record(self, role: str, scale: torch.Tensor, amax: torch.Tensor, counts: torch.Tensor | None) -> None:
        """Enter one cast into the scale state: amax history (delayed), last scale and amax, counts."""
        if self.fp8_config.delayed:
            record_amax(getattr(self, f"{role}_history"), amax)
        getattr(self, f"{role}_scale").copy_(scale)
        getattr(self, f"{role}_amax").copy_(amax)
        if counts is not None:
            getattr(self, f"{role}_counts").add_(counts)

    def _cast(self, role: str, x: torch.Tensor, record: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(fp8 values of x * scale, scale, amax, range counts or None)``; the values are float8
        tensors, or fp32 ones when emulating. Nothing is recorded here (``_record`` does that)."""
        fmt = ROLES[role]
        scale, amax = self._scale(role, x)
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
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q, q^T, scale, amax, counts or None)``: ``_cast`` plus the transpose backward multiplies by.

        Fused (``fused_casts``, eager, no range counting): one compiled kernel writes ``q`` and a
        contiguous ``q^T``. Otherwise ``q^T`` is a view and ``scaled_mm`` makes the layout it needs.
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
            return q, (q_t if q_t is not None else q.t()), scale, amax, None
        q, scale, amax, counts = self._cast(role, x, record)
        return q, q.t(), scale, amax, counts

    def _mm(self, a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
        mm = scaled_mm if self.backend == "scaled_mm" else emulated_mm
        return mm(a, b, inv_a, inv_b, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:            # (..., K)
        device_type = x.device.type
        autocast_on = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast_on else x.dtype
        record = self.training and torch.is_grad_enabled()
        x2d = x.reshape(-1, self.in_features)                        # (M, K)
        fn = _Fp8LinearFn if self.blocked is None else BlockedLinearFn
        with torch.autocast(device_type, enabled=False):             # the emulation's fp32 mm stays fp32
            out = fn.apply(x2d, self._weight_out_in(), self, out_dtype, record)             # (M, N)
        out = out.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def _weight_out_in(self) -> torch.Tensor:
        """The weight as ``(out, in)``; a layer that stores it transposed returns a view (fp8/conv1d.py)."""
        return self.weight

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

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_config}, backend={self.backend}"

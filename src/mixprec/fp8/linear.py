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
import torch.nn.functional as F
from torch import nn

from ..recipe.fp8 import Fp8Config
from .blocked_linear import BlockedLinearFn
from .layer_state import ROLES, Fp8LayerState

__all__ = ["Fp8Linear", "ROLES"]

class _Fp8LinearFn(torch.autograd.Function):
    """``x2d @ W^T`` in fp8; the layer object carries the scale state. Autocast is off inside."""

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, layer: Fp8Linear,
                out_dtype: torch.dtype, record: bool) -> torch.Tensor:
        # Backward multiplies by x (M, K) and W (N, K) as right-hand operands, which scaled_mm wants
        # column-major: the transposes of the (K, M) and (K, N) copies the fused cast writes, else
        # x_q and w_q themselves (row-major: scaled_mm copies them into that layout then).
        x_q, x_t, s_x, a_x, c_x = layer._cast_pair("input", x2d, record, ctx.needs_input_grad[1])    # (M, K)
        if hasattr(weight, "fp8_weight"):
            # FSDP2 all-gathered it in e4m3 (fp8/fsdp_weight.py): the cast ran on each shard, with
            # the whole weight's scale, before the gather. Range counts are not taken for it.
            w_q, s_w, a_w = weight.fp8_weight()
            w_q, w_t, c_w = (w_q if layer.backend == "scaled_mm" else w_q.to(torch.float32)), None, None
        else:
            w_q, w_t, s_w, a_w, c_w = layer._cast_pair("weight", weight, record, ctx.needs_input_grad[0])  # (N, K)
        # Reciprocals undo the scales after the matmul; exact when the scales are powers of two.
        inv_x, inv_w = s_x.reciprocal(), s_w.reciprocal()
        out = layer._mm(x_q, w_q.t(), inv_x, inv_w, out_dtype)     # (M, N)
        # Keep only what backward will use: the fp8 x for the weight gradient, the fp8 W for the input
        # gradient (a first layer fed with data needs no input gradient, so no copy of W is kept).
        ctx.save_for_backward((x_q if x_t is None else x_t.t()) if ctx.needs_input_grad[1] else None,
                              (w_q if w_t is None else w_t.t()) if ctx.needs_input_grad[0] else None,
                              inv_x, inv_w, s_x, a_x, c_x, s_w, a_w, c_w)
        ctx.layer, ctx.x_dtype, ctx.w_dtype, ctx.record = layer, x2d.dtype, weight.dtype, record
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The backward runs outside autocast unless the user's own is on here: only then turn it off
        # (entering torch.autocast costs a dozen Python calls per layer, every step).
        device_type = grad_out.device.type
        if torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return _Fp8LinearFn._grads(ctx, grad_out)
        return _Fp8LinearFn._grads(ctx, grad_out)

    @staticmethod
    def _grads(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_b, w_b, inv_x, inv_w, s_x, a_x, c_x, s_w, a_w, c_w = ctx.saved_tensors   # (M, K), (N, K)
        layer = ctx.layer
        g_q, g_t, s_g, a_g, c_g = layer._cast_pair("grad_output", grad_out, True, ctx.needs_input_grad[1])
        if ctx.record:
            # The forward's casts enter the scale state here, once per real forward: under activation
            # checkpointing the forward runs twice (the recompute with grad enabled) but this backward
            # once, and the recompute, seeing the history unchanged, casts exactly as the forward did.
            layer._record("input", s_x, a_x, c_x, "weight", s_w, a_w, c_w, "grad_output", s_g, a_g, c_g)
        else:
            layer._record("grad_output", s_g, a_g, c_g)
        inv_g = s_g.reciprocal()                                  # g_q (M, N) e5m2, g_t (N, M) or None
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = layer._mm(g_q, w_b, inv_g, inv_w, ctx.x_dtype)     # (M,N)@(N,K)
        if ctx.needs_input_grad[1]:
            grad_w = layer._mm(g_q.t() if g_t is None else g_t, x_b, inv_g, inv_x, ctx.w_dtype)  # (N,M)@(M,K)
        return grad_x, grad_w, None, None, None


class Fp8Linear(nn.Linear, Fp8LayerState):
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
        self._setup_fp8(config or Fp8Config(), backend, self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config, backend: str) -> Fp8Linear:
        """An Fp8Linear holding ``linear``'s very Parameters (no copy: optimizers keep their references)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        layer.train(linear.training)
        layer._setup_fp8(config, backend, layer.weight.device)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:            # (..., K)
        device_type = x.device.type
        autocast_on = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast_on else x.dtype
        record = self.training and torch.is_grad_enabled()
        x2d = x.reshape(-1, self.in_features)                        # (M, K)
        if x2d.shape[0] == 0:
            # An empty batch has no amax to scale by (torch has no max of nothing): it runs as the
            # base recipe's matmul (bf16 under autocast), the weight gradient is zeros and the scale
            # state records nothing, so no scale or history is made from it.
            out = F.linear(x2d, self._weight_out_in()).to(out_dtype)   # (0, N)
            return self._add_bias(out.view(*x.shape[:-1], self.out_features))
        fn = _Fp8LinearFn if self.blocked is None else BlockedLinearFn
        # Autocast off inside (the emulation's fp32 mm stays fp32). Where it is on, eager and with no
        # torch-function mode tracing (torch.export), flipping its flag around the call is what
        # torch.autocast(enabled=False) does there (an outer autocast holds the nesting, so no cache is
        # cleared) in two C calls instead of about twenty Python ones per layer and step.
        if (autocast_on and not torch.compiler.is_compiling()
                and not torch._C._is_torch_function_mode_enabled()):
            torch.set_autocast_enabled(device_type, False)
            try:
                out = fn.apply(x2d, self._weight_out_in(), self, out_dtype, record)         # (M, N)
            finally:
                torch.set_autocast_enabled(device_type, True)
        else:
            with torch.autocast(device_type, enabled=False):
                out = fn.apply(x2d, self._weight_out_in(), self, out_dtype, record)         # (M, N)
        return self._add_bias(out.view(*x.shape[:-1], self.out_features))

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _weight_out_in(self) -> torch.Tensor:
        """The weight as ``(out, in)``; a layer that stores it transposed returns a view (fp8/conv1d.py)."""
        return self.weight

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_config}, backend={self.backend}"

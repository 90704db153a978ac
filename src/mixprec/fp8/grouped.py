"""fp8 grouped GEMMs: a mixture of experts' projections, one 3-D weight multiplied group by group.

A mixture-of-experts layer sends each token to a few experts. With the S routed rows of ``x`` sorted
by expert and ``offs`` the running row count per expert (torch's ``_grouped_mm`` layout: expert ``e``
owns rows ``offs[e-1]:offs[e]``), one projection of all experts is::

    forward   y[rows of e]  = x[rows of e] @ W[e]^T        x (S, K), W (E, N, K), y (S, N)
    grad_x    gx[rows of e] = g[rows of e] @ W[e]           g (S, N), gx (S, K)
    grad_W    gW[e]         = g[rows of e]^T @ x[rows of e]  gW (E, N, K): 0 for an expert with no rows

``Fp8GroupedLinear`` runs the three in fp8 with per-tensor scaling, the numerics of ``Fp8Linear``
(fp8/linear.py): ``x`` and ``W`` in e4m3 and ``g`` in e5m2, each with one scale (current or delayed,
as the recipe says; the 3-D weight is one tensor, so all experts of a projection share its scale),
fp32 accumulation, one rounding to the output dtype. Its scale state, checkpoints and stats are
``Fp8Linear``'s (``Fp8LayerState``).

Emulated (``backend="emulate"``, every device): the fp8 values are held in fp32 and multiplied by
an fp32 grouped matmul (``grouped_mm_f32``: one ``torch._grouped_mm`` on a CPU, a loop over the
experts elsewhere). The products of fp8 values are exact in fp32, so the result equals a float64
computation from the dequantized operands up to fp32's summation rounding (tests/test_fp8_grouped.py).
``backend="scaled_mm"`` (Hopper, where ``devices.probe_fp8_kernel("grouped")`` finds it) runs the
forward GEMM on fp8 tensor cores through ``torch._scaled_grouped_mm`` when the output is bf16 (the only
output it writes); torch's grouped kernel takes e4m3 operands only, so the two gradient GEMMs, whose
``g`` is e5m2, stay emulated. The fp8 ``x`` and ``W`` are then saved as float8 (1 byte per value).

    >>> layer = Fp8GroupedLinear(4, 16, 32, Fp8Config())           # 4 experts, W (4, 16, 32)
    >>> x, w = torch.randn(10, 32), torch.randn(4, 16, 32)
    >>> offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)        # expert 1 got no rows
    >>> layer(x, w, offs).shape
    torch.Size([10, 16])
"""

from __future__ import annotations

from typing import Any

import torch

from ..recipe.fp8 import Fp8Config
from .layer_state import Fp8LayerState

__all__ = ["Fp8GroupedLinear", "grouped_mm_f32"]


@torch.library.custom_op("mixprec::grouped_mm_f32", mutates_args=())
def grouped_mm_f32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 grouped matmul; ``offs`` (E,) int32 ends each group's rows of ``a``'s grouped axis.

    ``a`` (S, K) and ``b`` (E, K, N): ``out[rows of e] = a[rows of e] @ b[e]``, (S, N).
    ``a`` (N, S) and ``b`` (S, K): ``out[e] = a[:, rows of e] @ b[rows of e]``, (E, N, K).

    A custom op, so ``torch.compile`` calls it as it is (Inductor's grouped matmul takes bf16 only).
    """
    if a.device.type == "cpu" and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offs)
    ends = offs.tolist()                         # elsewhere a loop: one host sync for the whole call
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[s:t] = a[s:t] @ b[e]
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    for e, (s, t) in enumerate(zip(starts, ends)):
        if t > s:
            out[e] = a[:, s:t] @ b[s:t]
    return out


@grouped_mm_f32.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


class _Fp8GroupedFn(torch.autograd.Function):
    """The three grouped GEMMs in fp8; the layer carries the scale state. Autocast is off inside."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, layer: Fp8GroupedLinear,
                out_dtype: torch.dtype, record: bool) -> torch.Tensor:
        # e4m3 values: float8 tensors for the kernel, fp32 ones when emulating.
        x_q, s_x, a_x, c_x = layer._cast("input", x, record)           # (S, K)
        w_q, s_w, a_w, c_w = layer._cast("weight", weight, record)     # (E, N, K)
        inv_x, inv_w = s_x.reciprocal(), s_w.reciprocal()              # exact for power-of-two scales
        if layer.backend == "scaled_mm" and out_dtype == torch.bfloat16:
            # Row scales: every row of x carries 1/s_x, every output column of every expert 1/s_w.
            (rows, _), (experts, n, _) = x_q.shape, w_q.shape
            out = torch._scaled_grouped_mm(x_q.contiguous(), w_q.contiguous().transpose(1, 2),
                                           inv_x.expand(rows).contiguous(), inv_w.expand(experts, n).contiguous(),
                                           offs=offs, out_dtype=out_dtype)
        else:
            out = (grouped_mm_f32(x_q.float(), w_q.float().transpose(1, 2), offs) * inv_x * inv_w).to(out_dtype)
        ctx.save_for_backward(x_q if ctx.needs_input_grad[1] else None,
                              w_q if ctx.needs_input_grad[0] else None, offs, inv_x, inv_w,
                              s_x, a_x, c_x, s_w, a_w, c_w)
        ctx.layer, ctx.x_dtype, ctx.w_dtype, ctx.record = layer, x.dtype, weight.dtype, record
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_q, w_q, offs, inv_x, inv_w, s_x, a_x, c_x, s_w, a_w, c_w = ctx.saved_tensors
        layer = ctx.layer
        if ctx.record:          # the forward's casts, entered once per real forward (as Fp8Linear does)
            layer._record("input", s_x, a_x, c_x)
            layer._record("weight", s_w, a_w, c_w)
        with torch.autocast(grad_out.device.type, enabled=False):
            g_q, s_g, a_g, c_g = layer._cast("grad_output", grad_out, True)      # (S, N) e5m2 values
            layer._record("grad_output", s_g, a_g, c_g)
            inv_g = s_g.reciprocal()
            g_q = g_q.float()           # the gradient GEMMs are emulated on every device (see the docstring)
            x_q = x_q.float() if x_q is not None else None
            w_q = w_q.float() if w_q is not None else None
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:
                grad_x = (grouped_mm_f32(g_q, w_q, offs) * inv_g * inv_w).to(ctx.x_dtype)         # (S, K)
            if ctx.needs_input_grad[1]:
                grad_w = (grouped_mm_f32(g_q.t(), x_q, offs) * inv_g * inv_x).to(ctx.w_dtype)     # (E, N, K)
        return grad_x, grad_w, None, None, None, None


class Fp8GroupedLinear(Fp8LayerState):
    """One expert projection's grouped GEMMs in fp8 (per-tensor scaling), and their scale state.

    It holds no weight: ``forward(x, weight, offs)`` takes the (E, N, K) weight the experts module owns
    (a view of it when the module stores it transposed), so the module's parameters, state_dict and
    optimizer stay as they were. Output dtype: the autocast dtype under autocast, else ``x``'s.
    """

    def __init__(self, num_experts: int, out_features: int, in_features: int, config: Fp8Config, *,
                 backend: str = "emulate", device: torch.device | str = "cpu") -> None:
        super().__init__()
        if config.blocked:
            raise ValueError(f"fp8={config.scaling.value}: grouped expert GEMMs take per-tensor scaling only "
                             "(fp8, fp8(delayed)); the blocked scalings cover nn.Linear layers")
        self.num_experts, self.out_features, self.in_features = num_experts, out_features, in_features
        self._setup_fp8(config, backend, torch.device(device))
        self.fused_casts = False          # the fused cast kernel writes 2-D transposes; a 3-D weight has none

    def forward(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if weight.shape != (self.num_experts, self.out_features, self.in_features):
            raise ValueError(f"grouped fp8 weight has shape {tuple(weight.shape)}, this layer multiplies "
                             f"({self.num_experts}, {self.out_features}, {self.in_features}) (experts, out, in)")
        device_type = x.device.type
        autocast_on = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast_on else x.dtype
        record = self.training and torch.is_grad_enabled()
        with torch.autocast(device_type, enabled=False):
            return _Fp8GroupedFn.apply(x, weight, offs, self, out_dtype, record)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, out_features={self.out_features}, in_features={self.in_features}, "
                f"fp8={self.fp8_config}, backend={self.backend}")

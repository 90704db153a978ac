"""Scaled fp8 matmuls: ``torch._scaled_mm`` where the device runs it, an exact emulation elsewhere.

``scaled_mm(a, b, inv_a, inv_b, out_dtype)`` computes ``(a @ b) * inv_a * inv_b`` with fp32
accumulation and rounds once to ``out_dtype``; ``a`` and ``b`` hold fp8 values (``x * scale``), and
``inv_*`` are the reciprocal scales that undo them. Two backends, one meaning:

- ``scaled_mm``: torch's ``_scaled_mm`` on float8 tensors (CUDA compute capability 8.9+, and recent
  CPU builds), always with ``use_fast_accum=False``. It wants ``a`` row-major and ``b`` column-major (Inductor too, on every device), and
  on CUDA the inner and output dimensions multiples of 16; the inner dimension is zero-padded when it
  is not (zeros add nothing).
- ``emulate``: the operands as fp32 tensors holding fp8 values (``formats.quantize``), an fp32 matmul,
  the same two scale multiplies, one rounding to ``out_dtype``. On a CPU it agrees with ``scaled_mm`` to
  within the output dtype's rounding (fp32 sums in another order differ in the last bits); on Hopper
  the fp8 tensor cores' accumulator is narrower than fp32 (tests/gpu/test_fp8_cuda.py derives the bound).

Whether the device runs ``torch._scaled_mm`` is ``mixprec.devices.probe_scaled_mm``'s answer.
"""

from __future__ import annotations

import torch

from ..devices import probe_scaled_mm

__all__ = ["probe_scaled_mm", "scaled_mm", "emulated_mm"]

_CUDA_ALIGN = 16                # cuBLASLt fp8 GEMMs need these dimensions in multiples of 16 elements


def _operands(a: torch.Tensor, b: torch.Tensor, pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` row-major and ``b`` column-major; with ``pad`` the inner dimension K zero-padded to a
    multiple of 16 (cuBLASLt). Every device gets the layouts: Inductor's lowering of ``_scaled_mm``
    demands them on CPU too, and an operand already in its layout is not copied.

    Zero columns of ``a`` and zero rows of ``b`` add nothing to the product. The padded copies are made
    with zeros + a slice copy (fill and copy run on every float8 dtype; a pad kernel may not).
    """
    (m, k), n = a.shape, b.shape[1]
    k_pad = k + (-k % _CUDA_ALIGN) if pad else k
    if k_pad == k:
        # b already column-major (the forward's W^T, a view of the row-major W) is used as it is:
        # transposing it twice to find that out cost two ops per matmul.
        stride = b.stride()
        if stride[0] != 1 or stride[1] != k:
            b = b.t().contiguous().t()
        return a.contiguous(), b
    a_p = a.new_zeros((m, k_pad))
    a_p[:, :k] = a
    b_t = b.new_zeros((n, k_pad))      # (N, K_pad) row-major: its transpose is (K_pad, N) column-major
    b_t[:, :k] = b.t()
    return a_p, b_t.t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a @ b) * inv_a * inv_b`` via ``torch._scaled_mm``: ``a`` (M, K) and ``b`` (K, N) float8."""
    a, b = _operands(a, b, pad=a.device.type == "cuda")   # the layouts (and on CUDA the alignment) required
    # Never fast accumulation, forward or gradient. Hopper's fp8 MMA keeps partial sums in a narrow
    # accumulator (about 14 significant bits); without fast accumulation cuBLAS adds them into fp32 at
    # intervals, with it only at the end. H100, K=8192, 2026-11-22: max error against the exact product
    # 14x sqrt(K) 2**-23 max|exact| without, 294x with it (profiles.txt). Gradients sum over the batch
    # (the weight gradient's K is M = batch x positions): the long sums that lose most.
    return torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype, use_fast_accum=False)


def emulated_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The same product from fp32 tensors that hold fp8 values: fp32 matmul, scales, one rounding."""
    # fp32 products of 4-bit significands are exact; only the fp32 sums round, as in the real kernel.
    return (torch.mm(a, b) * inv_a * inv_b).to(out_dtype)

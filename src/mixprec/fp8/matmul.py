"""Scaled fp8 matmuls: ``torch._scaled_mm`` where the device runs it, an exact emulation elsewhere.

``scaled_mm(a, b, inv_a, inv_b, out_dtype)`` computes ``(a @ b) * inv_a * inv_b`` with fp32
accumulation and rounds once to ``out_dtype``; ``a`` and ``b`` hold fp8 values (``x * scale``), and
``inv_*`` are the reciprocal scales that undo them. Two backends, one meaning:

- ``scaled_mm``: torch's ``_scaled_mm`` on float8 tensors (CUDA compute capability 8.9+, and recent
  CPU builds). On CUDA it wants ``a`` row-major, ``b`` column-major and the inner and output
  dimensions multiples of 16; the inner dimension is zero-padded when it is not (zeros add nothing).
- ``emulate``: the operands as fp32 tensors holding fp8 values (``formats.quantize``), an fp32 matmul,
  the same two scale multiplies, one rounding to ``out_dtype``. Agrees with ``scaled_mm`` to within
  the output dtype's rounding (fp32 sums in another order can differ in the last bits).

    >>> probe_scaled_mm("cpu")           # doctest: +SKIP
    Support(ok=True, reason='')
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..devices import Support

__all__ = ["probe_scaled_mm", "scaled_mm", "emulated_mm"]

_CUDA_FP8_CAPABILITY = (8, 9)   # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores
_CUDA_ALIGN = 16                # cuBLASLt fp8 GEMMs need these dimensions in multiples of 16 elements


@functools.lru_cache(maxsize=None)
def _probe(device: str) -> Support:
    if not hasattr(torch, "_scaled_mm"):
        return Support(False, f"torch {torch.__version__} has no torch._scaled_mm")
    dev = torch.device(device)
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if cap < _CUDA_FP8_CAPABILITY:
            return Support(False, f"{dev} is compute capability {cap[0]}.{cap[1]}; fp8 matmuls need 8.9 "
                                  "(Ada) or 9.0 (Hopper) or later")
    try:
        one = torch.ones((), device=dev)
        a = torch.ones(16, 16, device=dev).to(torch.float8_e5m2)       # the backward's e5m2 x e4m3
        b = torch.ones(16, 16, device=dev).to(torch.float8_e4m3fn).t()
        for out_dtype in (torch.float32, torch.bfloat16):
            out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out_dtype)
            if float(out[0, 0]) != 16.0:   # the probe's one host sync
                return Support(False, f"torch._scaled_mm on {dev} gave a wrong result")
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return Support(False, f"torch._scaled_mm does not run on {dev} with this torch build "
                              f"({str(exc).splitlines()[0][:120]})")
    return Support(True)


def probe_scaled_mm(device: torch.device | str) -> Support:
    """Whether ``torch._scaled_mm`` runs fp8 (e4m3 and e5m2) matmuls on ``device``, and if not, why.

    Runs one tiny matmul the first time a device is asked about (one host sync); cached afterwards.
    The probe always runs on real tensors: asked inside a fake-tensor trace (``memory_report``,
    ``inspect``) it steps out of the trace's dispatch modes for that matmul, where a fake result
    would read as "no fp8 here" and that verdict would be cached for the whole process.
    """
    # _disable_current_modes pops every TorchDispatchMode (FakeTensorMode among them) for the block
    # and restores them after; outside any mode it does nothing.
    with _disable_current_modes():
        return _probe(str(torch.device(device)))


def _cuda_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` row-major and ``b`` column-major, the inner dimension K zero-padded to a multiple of 16.

    Zero columns of ``a`` and zero rows of ``b`` add nothing to the product. The padded copies are made
    with zeros + a slice copy (fill and copy run on every float8 dtype; a pad kernel may not).
    """
    (m, k), n = a.shape, b.shape[1]
    k_pad = k + (-k % _CUDA_ALIGN)
    if k_pad == k:
        return a.contiguous(), b.t().contiguous().t()
    a_p = a.new_zeros((m, k_pad))
    a_p[:, :k] = a
    b_t = b.new_zeros((n, k_pad))      # (N, K_pad) row-major: its transpose is (K_pad, N) column-major
    b_t[:, :k] = b.t()
    return a_p, b_t.t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a @ b) * inv_a * inv_b`` via ``torch._scaled_mm``: ``a`` (M, K) and ``b`` (K, N) float8."""
    if a.device.type == "cuda":
        a, b = _cuda_operands(a, b)   # cuBLASLt's fp8 GEMM: layouts and alignment it requires
    return torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)


def emulated_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The same product from fp32 tensors that hold fp8 values: fp32 matmul, scales, one rounding."""
    # fp32 products of 4-bit significands are exact; only the fp32 sums round, as in the real kernel.
    return (torch.mm(a, b) * inv_a * inv_b).to(out_dtype)

"""Fused fp8 casts for eager mode: amax, scale, state update, saturating cast and the transposed copy
the backward needs, compiled once by torch's own compiler.

Eager, one role's cast is about a dozen kernels and six passes over the high-precision tensor: the
amax reduction, ``to(fp32)``, ``* scale``, ``isinf``, ``clamp``, ``where``, ``to(fp8)``, then a
transposed copy for the backward's column-major operand (benchmarks/HISTORY.md, H100 profiles: 88
kernels per fp8 linear forward+backward). Compiled, the same function is one reduction that reads the
tensor for its amax and one pointwise kernel that reads it again and writes the fp8 values in both
layouts; the scale arithmetic and the scale-state updates fold into those kernels. Under delayed
scaling the scale comes from the history, so the cast does not wait for this tensor's amax: Inductor
computes both in one pass over the tensor.

The numerics are those of ``scaling.py`` bit for bit (the same functions are what is compiled;
tests/test_fp8_fused.py checks it). Compiled with ``dynamic=True``: one graph serves every shape
(weights are passed detached, so torch.compile does not pin Parameter shapes). Graphs differ only by
the input dtype, the role's format, recording or not and whether the transposed copy is wanted;
Fp8Linear never records inside the cast (it enters each cast into the scale state in its backward,
once per real forward), which keeps the variants of a training run with evaluation within Dynamo's
default cache limit of 8 (beyond it a new variant runs eagerly: correct, unfused).
Where torch.compile cannot build it (no C++ compiler, no Triton, an old torch) the first call says
so once (``fusion.FusionWarning``) and every cast runs the same function eagerly.

Off by default (``layer.fused_casts = True`` turns it on): on an H200 with torch 2.11 the compiled
cast was slower than the eager one from 1024x1024 up, 23x at 8192x8192, and faster by about 60 us only
on tensors of 256x256 and less (benchmarks/fp8/bench_fp8_cast.py, RESULTS.md 2026-11-28).
"""

from __future__ import annotations

import torch

from ..formats import Format
from ..fusion import FusedFunction
from .scaling import amax_f32, cast_to_fp8, current_scale, delayed_scale, record_amax

__all__ = ["fused_cast"]


def _cast_role(x: torch.Tensor, scale_buf: torch.Tensor, amax_buf: torch.Tensor,
               history: torch.Tensor | None, fmt: Format, algo: str, margin: int, pow2: bool,
               record: bool, want_t: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(q, q^T contiguous or None, scale, amax)`` for one role, updating the scale state when ``record``
    (Fp8Linear passes False and records in its backward, once per real forward).

    The same steps as ``Fp8LayerState._cast`` + ``cast_to_fp8`` (see there for the numerics).
    """
    amax = amax_f32(x)
    if history is not None:
        scale = delayed_scale(history, amax, scale_buf, fmt, algo=algo, margin=margin, pow2=pow2)
        if record:
            record_amax(history, amax)
    else:
        scale = current_scale(amax, fmt, margin=margin, pow2=pow2)
    if record:
        scale_buf.copy_(scale)
        amax_buf.copy_(amax)
    q = cast_to_fp8(x, scale, fmt)
    # The backward's operand in the layout _scaled_mm wants, written by the same kernel as q.
    q_t = q.t().contiguous() if want_t else None
    return q, q_t, scale, amax


_fused_cast_role = FusedFunction(_cast_role, "fp8 cast")


def fused_cast(x: torch.Tensor, scale_buf: torch.Tensor, amax_buf: torch.Tensor,
               history: torch.Tensor | None, fmt: Format, *, algo: str, margin: int, pow2: bool,
               record: bool, want_t: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``_cast_role`` compiled (``fusion.FusedFunction``), or run eagerly where that cannot be built."""
    return _fused_cast_role(x, scale_buf, amax_buf, history, fmt, algo, margin, pow2, record, want_t)

"""Constant operands of a step's small elementwise ops as 0-d tensors, made once per value, dtype and
device.

A Python number as an operand (``bits.add_(0x8000)``) is wrapped into a fresh 0-d tensor at every
call, and where that tensor's dtype is not the other operand's (a Python int is int64) the kernel takes
a slower path. A kept 0-d tensor of the operand's own dtype skips both. Measured on the CPU (torch
2.13, one thread, 1000 elements, warm): ``add_`` of an int32 constant 3.6 us as a Python int, 1.5 us
as a 0-d int32 tensor; an xor into a strided int16 view 9.5 against 4.2. bf16-kahan's split and join
run such ops at every step (``bit_views.Fp32Bits`` keeps their constants); the values are the same bits.

    >>> operand(0x8000, torch.int32, torch.device("cpu"))
    tensor(32768, dtype=torch.int32)
    >>> operand(0x8000, torch.int32, torch.device("cpu")) is operand(0x8000, torch.int32, torch.device("cpu"))
    True

The tensors are shared: read them, never write into them. Traced code (``torch.compile``) and a CUDA
stream being captured get the Python number itself (no tensor is made or looked up inside a graph).
"""

from __future__ import annotations

import torch

__all__ = ["operand"]

_MADE: dict[tuple[float | int, torch.dtype, torch.device], torch.Tensor] = {}


def operand(value: float | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | float | int:
    """``value`` as a kept 0-d ``dtype`` tensor on ``device``; the number itself while tracing or
    capturing. ``value`` must equal itself (no NaN: a NaN key is never found again)."""
    if torch.compiler.is_compiling():
        return value
    key = (value, dtype, device)
    made = _MADE.get(key)
    if made is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return value
        made = _MADE[key] = torch.tensor(value, dtype=dtype, device=device)
    return made

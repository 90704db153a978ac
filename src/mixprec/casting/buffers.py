"""Which buffers a pure recipe may cast to 16 bits: buffers are not weights.

A pure recipe (fp16/bf16 weights) casts parameters because the optimizer's fp32 master copy keeps
their exact values. Buffers have no master copy: what a cast rounds away is gone for good. A Llama's
rotary ``inv_freq`` in bf16 (8 significant bits) puts the position angle ``pos * inv_freq`` off by
0.63 rad at position 512 and by 10 rad at 8191 (head_dim 128), silently, since short test sequences
hide it. So each floating buffer of a 16-bit module is decided on its own:

- **running statistics stay fp32**: the buffers of batch/instance norms (``running_mean``,
  ``running_var``), and any buffer named ``running_*``. They average many small updates; a 16-bit
  average stops moving once an update is below half its ulp (the lost-update rule: an update below half an ulp rounds away).
- **mixprec's own fp8 scale state stays fp32** (``Fp8Linear``'s scales and amax histories).
- **everything else is cast only if the cast is exact**: ``buf.to(dtype).to(buf.dtype) == buf``
  element for element (NaN where NaN, infinities kept). A causal mask of 0 and -inf, a mask of 0/1,
  an all-ones scale are exact in fp16 and bf16 and are cast (activations then meet a buffer of their
  own dtype and stay 16-bit). Frequency tables, sinusoidal position tables and anything else that a
  cast would round stay fp32: autocast still runs the matmuls in 16 bits, and an elementwise op with
  an fp32 buffer computes in fp32.
- a buffer whose values cannot be read (``meta`` tensors, fake tensors in ``memory_report``'s trace)
  stays as it is: nothing proves its cast exact.

    >>> m = nn.Module()
    >>> m.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
    >>> m.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
    >>> [(d.name, d.cast) for d in cast_buffers(m, torch.bfloat16)]
    [('inv_freq', False), ('mask', True)]
    >>> m.inv_freq.dtype, m.mask.dtype
    (torch.float32, torch.bfloat16)

One host sync per buffer (the exactness check reads a flag), once, when the model is prepared.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["BufferDecision", "cast_buffers", "decide_buffer"]

# Keep running statistics: BatchNorm*d, SyncBatchNorm, InstanceNorm*d (the lazy ones too) share this base.
_NORM_WITH_STATS = nn.modules.batchnorm._NormBase


@dataclasses.dataclass(frozen=True)
class BufferDecision:
    """One floating buffer: its name (qualified from where ``cast_buffers`` was called), whether it was
    cast, and why."""

    name: str
    dtype: torch.dtype       # the dtype it has now
    cast: bool
    reason: str


def decide_buffer(module: nn.Module, name: str, buf: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """``(cast, reason)`` for the floating buffer ``name`` of ``module`` under a ``dtype`` pure recipe."""
    if isinstance(module, _NORM_WITH_STATS) or name.startswith("running_"):
        return False, "running statistics stay fp32"
    if hasattr(module, "fp8_state"):
        return False, "fp8 scale state stays fp32"
    if buf.dtype == dtype:
        return False, f"already {dtype}"
    if buf.device.type == "meta" or _is_fake(buf):
        return False, "values unknown (meta or fake tensor): kept as it is"
    if not _cast_is_exact(buf, dtype):
        return False, f"a {dtype} cast would round it (frequency, position or other exact table)"
    return True, f"exact in {dtype}"


def cast_buffers(model: nn.Module, dtype: torch.dtype, *, skip: frozenset[str] = frozenset(),
                 prefix: str = "") -> list[BufferDecision]:
    """Cast ``model``'s floating buffers to ``dtype`` where ``decide_buffer`` allows; in place.

    ``skip`` holds qualified module names whose buffers are left alone entirely (modules the recipe
    keeps fp32). A buffer shared by two modules is decided once. Returns one decision per floating
    buffer, in module order.
    """
    decisions: list[BufferDecision] = []
    done: dict[int, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        if mod_name in skip:
            continue
        for buf_name, buf in list(module.named_buffers(recurse=False)):
            if buf is None or not buf.is_floating_point():
                continue
            qualified = f"{prefix}{mod_name}.{buf_name}" if mod_name else f"{prefix}{buf_name}"
            if id(buf) in done:                       # shared: give this module the same tensor
                setattr(module, buf_name, done[id(buf)])
                continue
            cast, reason = decide_buffer(module, buf_name, buf, dtype)
            new = buf.to(dtype) if cast else buf
            done[id(buf)] = new
            if cast:
                setattr(module, buf_name, new)        # keeps the buffer's persistence
            decisions.append(BufferDecision(qualified, new.dtype, cast, reason))
    return decisions


def _cast_is_exact(buf: torch.Tensor, dtype: torch.dtype) -> bool:
    back = buf.to(dtype).to(buf.dtype)
    # equal_nan: a NaN placeholder stays NaN; infinities compare equal to themselves.
    return bool(torch.equal(back, buf) or torch.allclose(back, buf, rtol=0.0, atol=0.0, equal_nan=True))


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:   # pragma: no cover - every torch we support has it
        return False
    return isinstance(t, FakeTensor)

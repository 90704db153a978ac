"""Views of a flat fp32 buffer's bit pattern, made once for a buffer the step reuses.

bf16 is the high 16 bits of an fp32. Stochastic rounding (``stochastic_rounding.stochastic_round_bf16_``)
and Kahan's split and join (``update/kahan.py``) work on a chunk's fp32 weights as integers and read the
rounded bf16 weights where they lie, the high halves. Each such pass needs the buffer viewed as int32,
as bf16 high halves and as int16 low halves: two view ops apiece, and Kahan's passes also need a few
integer constants as operands (0-d tensors of the views' dtypes: ``update/operands.py`` says why). A small
model's step reuses one buffer (``master.MasterWeights._transient_layout``), so its views and constants
are made once and kept with it; a buffer made for one step gets fresh views.

On a little-endian machine (x86, ARM, GPUs) the high half of an fp32 is the later in memory.

    >>> v = Fp32Bits(torch.tensor([1.0, -2.0]))
    >>> v.high.tolist(), hex(v.bits[0].item())
    ([1.0, -2.0], '0x3f800000')
"""

from __future__ import annotations

import sys
from functools import cached_property

import torch

from .operands import operand

__all__ = ["Fp32Bits", "HIGH_HALF", "LOW_HALF"]

HIGH_HALF = 1 if sys.byteorder == "little" else 0    # which 16-bit half of an fp32 is its top
LOW_HALF = 1 - HIGH_HALF


class Fp32Bits:
    """1-D fp32 ``flat`` as ``bits`` (int32), ``high`` (bf16 high halves, stride 2) and ``low`` (int16
    low halves, stride 2): views of the same memory, each made at its first use and kept; with the
    constants ``half_ulp``, ``low_top`` and ``magnitude`` the same way."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.n = flat.shape[0]

    @cached_property
    def bits(self) -> torch.Tensor:
        return self.flat.view(torch.int32)

    @cached_property
    def high(self) -> torch.Tensor:
        return self.flat.view(torch.bfloat16)[HIGH_HALF::2]

    @cached_property
    def low(self) -> torch.Tensor:
        return self.flat.view(torch.int16)[LOW_HALF::2]

    @cached_property
    def half_ulp(self) -> torch.Tensor | int:
        """0x8000 (int32): half a bf16 ulp in the fp32 pattern, the top bit of the low half."""
        return operand(0x8000, torch.int32, self.flat.device)

    @cached_property
    def low_top(self) -> torch.Tensor | int:
        """The low half's top bit as an int16 (-32768 is 0x8000): an xor with it adds 32768 mod 2**16."""
        return operand(-32768, torch.int16, self.flat.device)

    @cached_property
    def magnitude(self) -> torch.Tensor | int:
        """0x7FFF8000 (int32): the high half's magnitude bits and the low half's top bit."""
        return operand(0x7FFF8000, torch.int32, self.flat.device)

"""Kahan-compensated bf16 weights (``rounding=kahan``, recipe ``bf16-kahan``): bf16 weights plus a
16-bit compensation per weight that holds the rest of the fp32 value, exactly. 2 + 2 bytes per parameter
hold what an fp32 master holds; the optimizer steps the exact fp32 value, as under ``bf16-pure``.

An fp32 value is 32 bits; bf16 is its high 16. So the compensation is not a second bf16 float but the
low 16 bits, made signed so that the weight can be the *nearest* bf16 value::

    bits(x)  = (bits(w) << 16) + c          w: bf16, the high half rounded to nearest (ties away from 0)
                                            c: int16 in [-32768, 32767], the rounding error in fp32 ulps

Splitting: ``bits(x) + 0x8000`` carries into the high half exactly when the low half is at least
0x8000, so the sum's high half is ``w`` and its low half is ``c + 0x8000``: one integer add, and
``c = low ^ 0x8000`` (reinterpreting ``c + 32768`` in [0, 65536) as signed subtracts 32768). Joining:
cast ``w`` to fp32 (exact: ``bits(w) << 16``) and add ``c`` to the bit pattern. Both are integer
arithmetic on the pattern, so the pair gives back ``x`` bit for bit, whatever ``x`` is: subnormal,
signed zero, a value whose weight rounds up across a power of two or to inf::

    >>> x = torch.tensor([1 + 2**-20, 1 + 2**-8, -3e-39, 3.4e38])
    >>> comp = torch.empty(4, dtype=torch.int16)
    >>> w = split_(x.clone(), comp, [[0, 0, 4]]).float()  # 1 + 2**-8 is a tie: away from zero
    >>> w.tolist()[:2], w[3].item(), comp.tolist()[:2]
    ([1.0, 1.0078125], inf, [8, -32768])
    >>> add_compensation_(w, comp, [[0, 0, 4]]); torch.equal(w, x)
    True

Why not the textbook Kahan pair (a bf16 ``c``, ``c = bf16(x - w)``): ``x - w`` has up to 16
significant bits and a bf16 keeps 8, so each step loses the rest, and the losses need not cancel:
adding 1e-4 to 1.0 a thousand times, that pair ends at 1.1028, fp32 (and this pair) at 1.10002. And
the optimizer would see ``fp32(w + c)``, a second rounding where ``c`` is tiny. The integer low half
is exact, and as cheap: integer adds and an xor on the bit pattern, no float rounding to reason about.

Ties go away from zero, not to even: 65536 compensation values cannot say both "rounded down by
half an ulp" and "rounded up by half an ulp" (65537 errors in all). So where ``x`` lies exactly
halfway between two bf16 values (its low half is 0x8000), ``bf16-kahan``'s weight is one bf16 ulp
from ``bf16-pure``'s; the optimizer's fp32 values are the same bits.

A weight changed outside the step (``model.load_state_dict``, an in-place edit under ``no_grad``, a
re-initialised layer) is the truth: its fp32 value is the new weight, so its compensations are zeroed
(``reset_``). ``MasterWeights.adopt_model_changes`` finds such a weight by its version counter (one
int compare per weight per step); a write through ``param.data`` moves no counter and goes unseen, so
the old compensations stay joined to it (within half a bf16 ulp of the new value).

Whatever a compensation holds, the join of a finite weight is finite: the only finite weights whose
pattern plus a compensation leaves the finite range are the zeros with a negative compensation
(``0 - 1`` in the bits is 0xFFFFFFFF, a NaN; no split makes that pair: a zero is never rounded up), so
the join makes those +0.0 (three more integer passes; measured in benchmarks/HISTORY.md, issue 33).

NaN: a NaN's pattern plus 0x8000 may overflow int32 (0x7FFF8000 and up), so NaNs are made the
canonical 0x7FC00000 first (low half zero), as ``stochastic_round_bf16_`` does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .bit_views import Fp32Bits

__all__ = ["KahanCompensation", "split_", "add_compensation_"]

_BF16_INF = 0x7F80                                    # the magnitude bits of a bf16 inf


def _stretches(low: torch.Tensor, comp: torch.Tensor, runs: list[list[int]],
               n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(low halves, compensations)`` per run; the tensors themselves where one run covers both."""
    if len(runs) == 1 and runs[0] == [0, 0, n] and comp.shape[0] == n:
        return [(low, comp)]
    return [(low[offset:offset + length], comp[start:start + length]) for offset, start, length in runs]


def split_(flat: torch.Tensor, comp: torch.Tensor, runs: list[list[int]],
           views: Fp32Bits | None = None) -> torch.Tensor:
    """Split 1-D fp32 ``flat`` in place into bf16 weights (returned: a strided view of its high halves)
    and compensations, written into int16 ``comp``.

    ``runs``: ``[offset in flat, start in comp, length]`` stretches (``comp`` is laid out by the
    step's order, ``flat`` by the chunk's). ``flat`` is meaningless as fp32 afterwards. ``views``:
    ``flat``'s bit views, kept by a caller that splits the same buffer at every step.
    """
    views = views if views is not None else Fp32Bits(flat)
    torch.nan_to_num_(flat, nan=math.nan, posinf=math.inf, neginf=-math.inf)   # identity but for NaN
    views.bits.add_(views.half_ulp)   # carries into the high half iff the low one >= 0x8000
    # The low halves now hold c + 0x8000, as unsigned 16 bits. -32768 is 0x8000 as int16: the xor
    # subtracts 32768 modulo 2**16, giving c's two's complement.
    top = views.low_top
    for low, c in _stretches(views.low, comp, runs, views.n):
        torch.bitwise_xor(low, top, out=c)
    return views.high


def add_compensation_(flat: torch.Tensor, comp: torch.Tensor, runs: list[list[int]],
                      views: Fp32Bits | None = None) -> None:
    """Turn 1-D fp32 ``flat``, whose high halves hold bf16 weights, into the exact fp32 values;
    ``runs`` (as for ``split_``) must cover all of ``flat``; ``views`` as for ``split_``.

    ``split_`` backwards: ``c + 0x8000`` into each low half, then subtract 0x8000 from the pattern
    (a borrow from the high half where ``c`` is negative). Not ``bits.add_(comp)``: int32 plus int16
    makes an int32 copy of ``comp`` first, 4 B per weight of transient memory, for no speed (3.3M
    weights, one CPU thread: 5.1 ms that way, 5.4 ms this way).
    """
    views = views if views is not None else Fp32Bits(flat)
    top = views.low_top
    for low, c in _stretches(views.low, comp, runs, views.n):
        torch.bitwise_xor(c, top, out=low)
    bits = views.bits
    # A zero weight (magnitude bits 0) with c < 0 (low half now below 0x8000): the sub would borrow
    # through the sign into a NaN. No split makes that pair; the join makes it +0.0.
    # possible: 1 where those bits are not all 0, else 0 (sign_ of a value >= 0: the mask clears the
    # sign bit), and the pattern is multiplied by it. Not `== 0` (a Python number is wrapped in a
    # tensor first) nor a bool mask and masked_fill_: 19 us on the tiny model's 19,209 weights against
    # 61 that way. sign_ rather than clamp_(max=1): 1.9 against 4 us at 1000 elements.
    possible = bits.bitwise_and(views.magnitude).sign_()
    bits.sub_(views.half_ulp)
    bits.mul_(possible)


class KahanCompensation:
    """The int16 compensations of ``params`` (bf16 weights), laid end to end at ``starts``.

    Built while the parameters are still fp32: each initial value is split, its compensation kept
    and the parameter set to its bf16 rounding (ties away from zero; the cast to bf16 that follows
    keeps it exactly), so the first step's fp32 view is the initial weights bit for bit.
    """

    def __init__(self, params: list[nn.Parameter], starts: list[int], total: int) -> None:
        self.params = params
        self.starts = starts
        device = params[0].device if params else torch.device("cpu")
        self.comp = torch.zeros(total, dtype=torch.int16, device=device)
        with torch.no_grad():
            for p, start in zip(params, starts):
                flat = p.detach().reshape(-1).float()     # a copy: split_ writes into it
                w = split_(flat, self.comp, [[0, start, p.numel()]])
                p.data.copy_(w.view(p.shape))

    @property
    def nbytes(self) -> int:
        """Bytes held between steps: 2 per weight."""
        return self.comp.numel() * self.comp.element_size()

    def join_(self, flat: torch.Tensor, which: list[int], runs: list[list[int]],
              views: Fp32Bits | None = None) -> None:
        """``flat`` holds the bf16 weights of positions ``which`` as fp32 (an exact cast): add the
        compensations, so it holds the fp32 values the last step left. No sync."""
        add_compensation_(flat, self.comp, runs, views)

    def split_(self, flat: torch.Tensor, runs: list[list[int]], views: Fp32Bits | None = None) -> torch.Tensor:
        """The optimizer's fp32 result in ``flat`` -> compensations kept; returns the bf16 weights
        (a strided view into ``flat``) for the caller to copy into the model."""
        return split_(flat, self.comp, runs, views)

    def reset_(self, i: int) -> None:
        """Zero parameter ``i``'s compensations: its fp32 value is its bf16 weight (a weight the user
        set is the truth, not the old weight's remainder joined to it)."""
        self.comp[self.starts[i]:self.starts[i] + self.params[i].numel()].zero_()

    def fp32_weights(self) -> list[torch.Tensor]:
        """Each parameter's exact fp32 value (weight joined with its compensation), shaped like it."""
        out = []
        for p, start in zip(self.params, self.starts):
            flat = p.detach().reshape(-1).float()
            add_compensation_(flat, self.comp, [[0, start, p.numel()]])
            out.append(flat.view(p.shape))
        return out

    def state_dict(self) -> list[torch.Tensor]:
        """One int16 tensor per parameter, shaped like it (copies)."""
        return [self.comp[s:s + p.numel()].view(p.shape).clone() for p, s in zip(self.params, self.starts)]

    def check_state(self, saved: Any) -> None:
        """Raise ValueError unless ``saved`` is a ``state_dict()`` of compensations for these weights."""
        fix = "was it saved from a different model, or under a recipe other than bf16-kahan?"
        if not isinstance(saved, (list, tuple)):
            raise ValueError(f"the Kahan compensation state is {type(saved).__name__}, not a list of "
                             f"int16 tensors (one per bf16 weight): {fix}")
        if len(saved) != len(self.params):
            raise ValueError(f"the Kahan compensation state holds {len(saved)} tensors, this model has "
                             f"{len(self.params)} bf16 weights: {fix}")
        for i, (p, c) in enumerate(zip(self.params, saved)):
            if not isinstance(c, torch.Tensor):
                raise ValueError(f"Kahan compensation {i} is {type(c).__name__}, not a tensor: {fix}")
            if c.dtype != torch.int16 or c.shape != p.shape:
                raise ValueError(f"Kahan compensation {i} is {c.dtype} {tuple(c.shape)}, the weight needs "
                                 f"torch.int16 {tuple(p.shape)} (the low 16 bits of its fp32 value): {fix}")

    def load_state_dict(self, saved: list[torch.Tensor]) -> None:
        """Restore ``state_dict()``'s output (checked first). The weights must be loaded already or
        next: the compensation belongs to the weights of the same checkpoint."""
        self.check_state(saved)
        for p, s, c in zip(self.params, self.starts, saved):
            self.comp[s:s + p.numel()].copy_(c.reshape(-1))

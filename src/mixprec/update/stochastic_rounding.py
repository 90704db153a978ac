"""Stochastic rounding of fp32 to bf16: unbiased in expectation, so an update smaller than half a bf16
ulp survives on average (the ``bf16-sr`` recipe and compact Adam moments).

- ``stochastic_round_bf16(x, generator)``: out of place, one generator draw per element
  (``compact_adamw`` rounds its moments so).
- ``stochastic_round_bf16_(x, noise)``: in place over a flat fp32 buffer, reading the rounded bf16
  values where they lie (``MasterWeights`` rounds a whole chunk of transient fp32 weights so).
- ``RoundingNoise``: the uniform 16-bit noise of bf16-sr as a hash of (seed, steps taken, position):
  no per-element draw, the same on every device and under every chunking, and a skipped step leaves
  it where it was.

    >>> w = torch.full((100_000,), 1.0)
    >>> stochastic_round_bf16(w + 2**-10, torch.Generator().manual_seed(0)).float().mean().item()
    1.0009...
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .bit_views import Fp32Bits

__all__ = ["RoundingNoise", "run_fill_plan", "stochastic_round_bf16", "stochastic_round_bf16_"]

_MASK32 = 0xFFFFFFFF
_AHEAD_STEPS = 64             # steps of rounding-noise tables hashed in one batch (RoundingNoise.tables)
_AHEAD_ENTRIES = 1 << 18      # at most this many int32 entries in that batch (1 MiB)


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down with probabilities that make the result unbiased.

    bf16 is fp32 with the low 16 mantissa bits dropped. Adding a uniform integer in [0, 2**16) to the
    bit pattern and then truncating those bits carries into bit 16 with probability equal to the
    dropped fraction of an ulp, for either sign (the low bits are magnitude bits). NaN stays NaN.
    A value above bf16's largest finite one rounds to it or, carrying into the exponent, to inf.

    The noise comes from ``generator``, one draw per element (``compact_adamw`` rounds its moments so).
    ``MasterWeights`` rounds a whole chunk in place instead (``stochastic_round_bf16_``), with noise
    that costs no per-element draw (``RoundingNoise``).
    """
    assert x.dtype == torch.float32, "stochastic rounding reads the fp32 bit pattern"
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # -65536 == 0xFFFF0000 as int32: clears the 16 bits bf16 does not hold, so .to(bf16) below is exact.
    rounded = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


def stochastic_round_bf16_(x: torch.Tensor, noise: torch.Tensor, views: Fp32Bits | None = None) -> torch.Tensor:
    """Round 1-D fp32 ``x`` to bf16 up or down without bias, in place; returns the bf16 result as a
    view into ``x`` (each element's high half), and leaves ``x`` itself meaningless as fp32.

    ``noise``: int32 uniform in [0, 2**16), one per element. The trick of ``stochastic_round_bf16``
    in two passes over a flat buffer: the sum's high 16 bits are the rounded value, so they are read
    where they lie, a strided bf16 view, instead of clearing the low bits in a third pass and casting.
    A value that is already bf16 (low 16 bits zero) stays itself whatever the noise: no carry.

    NaN: adding to a NaN's bit pattern may carry out of it (CUDA's canonical NaN is 0x7FFFFFFF:
    +1 gives 0x80000000, -0.0), or leave a NaN whose payload sat in the low bits as inf. So NaNs are
    first replaced by 0x7FC00000, whose low 16 bits are zero (no int32 sum can overflow then: the
    largest pattern is 0x7FC00000 + 0xFFFF). +-inf have zero low bits and stay. A finite value above
    bf16's largest (0x7F7F0000) rounds to it or, carrying into the exponent, to inf: the next pattern
    up, as ``stochastic_round_bf16`` does.

    ``views``: ``x``'s bit views, kept by a caller that rounds the same buffer at every step.
    """
    views = views if views is not None else Fp32Bits(x)
    torch.nan_to_num_(x, nan=math.nan, posinf=math.inf, neginf=-math.inf)   # identity but for NaN
    views.bits.add_(noise)
    # An fp32 is two bf16-sized halves; the high one holds the sign, exponent and top 7 mantissa bits.
    return views.high


def run_fill_plan(plan: list[tuple[torch.Tensor, ...]]) -> None:
    """Write the noise ``RoundingNoise.fill_plan`` laid out: one xor per stretch, into its view."""
    for a, b, out in plan:
        torch.bitwise_xor(a, b, out=out)


def _mix32(x: Any) -> Any:
    """A bijective 32-bit integer hash (Chris Wellons' "lowbias32") of ``x`` in [0, 2**32): an int64
    tensor, or a Python int (the same operators).

    Xor-shifts and multiplications by odd constants modulo 2**32, each invertible; good avalanche
    (flipping an input bit flips each output bit with probability ~1/2). In int64 with no overflow:
    the operand is below 2**32 and each multiplier below 2**31 in magnitude (0x846CA68B is used as
    0x846CA68B - 2**32: the same product modulo 2**32), and ``& _MASK32`` takes the product modulo
    2**32 (two's complement bits, so a negative product masks correctly too).
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * -0x7B935975) & _MASK32
    return x ^ (x >> 16)


class RoundingNoise:
    """The uniform 16-bit noise of bf16-sr: a function of (seed, steps taken, position), no draws.

    Why not ``torch.randint`` per element: a CPU generator draws one 32-bit number per element in a
    serial loop, measured at 11-20 ms for 3.3M elements on a 2-core CPU, where the whole rounding
    below takes ~3 ms. So each step has two small tables (eager steps pick them from a batch hashed
    for the next steps at once: ``tables``) and the noise of element ``g`` (its
    position among all the step's fp32 copies laid end to end, in the optimizer's order) is::

        noise[g] = T[g % M] ^ U[g // M]          M a power of two >= sqrt(numel), len(U) = ceil(numel / M)

    With every entry of T and U uniform and independent of the others: each noise value is uniform (a
    uniform value xor anything independent of it is uniform), and any two positions are independent:
    if they differ in ``g % M`` they xor two different entries of T, each uniform whatever the rest
    holds; if not, they differ in ``g // M`` and so in their entries of U. Pairwise independence is
    all the variance of a sum of rounding errors depends on: a dot product with rounded weights
    scatters exactly as under independent noise. (Four positions on a rectangle xor to zero: a
    dependence of order four only.) Writing the noise of a chunk is one broadcast xor, plus one for a
    partial row at each end.

    The tables are hashed (``_mix32``) from the seed, the entry's index and ``rounds``, an int64 on
    the device counting the steps taken: ``advance`` adds ``1 - found_inf`` there, so a step the
    optimizer skipped in its kernel leaves the next step's noise where it was, without a host sync.
    The seed and ``rounds`` are the whole state (``get_state``, three int64): a run resumes with the
    same noise on any device.

    The interface mirrors ``torch.Generator``'s ``get_state``/``set_state`` because it stands where
    one stood (``MasterWeights.generator``, the ``"generator"`` entry of its state).
    """

    def __init__(self, seed: int, numel: int, device: torch.device | str) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int (the stochastic-rounding seed, e.g. seed=0), "
                             f"got {seed!r}")
        self.numel = numel
        self.device = torch.device(device)
        # The table width: the least power of two with width**2 >= numel, so U is no longer than T
        # and the two hold at most ~4 sqrt(numel) entries (a 7B model: ~185K).
        self.width = 1 << max(0, math.isqrt(max(numel - 1, 0)).bit_length())
        self.rows = -(-numel // self.width)
        # [steps taken, steps taken since the batch of tables was hashed]: one add counts a step in
        # both, and the second is the row the next step picks (``tables``), with no op to work it out.
        self._counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.rounds = self._counts[0]
        self._offset = self._counts[1:]          # (1,): index_select's index
        self._ones = torch.ones(2, dtype=torch.int64, device=self.device)   # a step taken, no wrap
        # Tables for the next ``_ahead`` steps, hashed in one batch (``tables``): one small op a step
        # instead of ~25. At most _AHEAD_ENTRIES int32 held; a model too large for two steps' worth
        # hashes each step's tables alone, as its compute dwarfs the launches anyway.
        self._ahead = min(_AHEAD_STEPS, _AHEAD_ENTRIES // (self.width + self.rows))
        self._batch: torch.Tensor | None = None     # (_ahead, width + rows) int32: rows for origin + j
        self._advances = 0                          # advance() calls since then: the offset is <= this
        # Eager steps: this step's row of the batch is written here (index_select's out=), so T and U
        # are the same two views at every step and a caller may keep views of them (``fill_plan``).
        self._row: torch.Tensor | None = None
        self._row_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._seed(seed % 2**64)        # any int: Python's modulo maps negatives into [0, 2**64)

    def _seed(self, seed64: int) -> None:
        self.key = (seed64 & _MASK32, seed64 >> 32)
        # The seed's two halves hashed into one word first: seeds 0 and 1 must not share table
        # entries (index + seed would: entry j of one is entry j + 1 of the other).
        word = _mix32(_mix32(self.key[0]) ^ self.key[1])
        index = torch.arange(self.width + self.rows, dtype=torch.int64, device=self.device)
        # Per entry and seed, fixed for the run (hashed once here): a step only xors its own word in.
        # The index times 0x9E3779B9 (2**32 / golden ratio, odd) spreads neighbouring entries apart.
        self._base = _mix32((index * 0x9E3779B9 + word) & _MASK32)
        self._batch = None

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's ``(T, U)``: int32 in [0, 2**16), ``width`` and ``rows`` entries. No sync.

        Eager, the tables of the next steps are hashed together once (``_ahead`` of them: a row per
        step count from the current one on) and each step picks its row by ``rounds`` on the device,
        so a skipped step, which leaves ``rounds`` where it was, picks the same row again. Row ``j``
        is bit for bit the tables hashed alone at ``origin + j``; it is written into the same two
        tensors at every eager step (valid until the next call). The batch is hashed afresh once
        ``advance`` has been called ``_ahead`` times since (the steps taken since can only have
        reached that then) or the state was set. Traced (``torch.compile``): hashed alone, in the
        graph, and the batch is dropped (the graph moves ``rounds`` where this object cannot count).
        """
        if self._ahead < 2 or torch.compiler.is_compiling():
            self._batch = None
            return self._split(self._hashed(self.rounds))
        if self._batch is None or self._advances >= self._ahead:
            steps = self.rounds + torch.arange(self._ahead, dtype=torch.int64, device=self.device)
            self._batch = self._hashed(steps[:, None])                        # (ahead, width + rows)
            self._offset.zero_()        # the batch's origin is the count now
            self._advances = 0
            if self._row is None:      # the same shape for the whole run: made once
                self._row = torch.empty((1, self.width + self.rows), dtype=torch.int32, device=self.device)
                self._row_tables = (self._row[0, :self.width], self._row[0, self.width:])
        # One op a step: the row of the steps taken since (counted on the device) into the kept one.
        torch.index_select(self._batch, 0, self._offset, out=self._row)
        return self._row_tables

    def _hashed(self, rounds: torch.Tensor) -> torch.Tensor:
        """The entries of T then U for step count(s) ``rounds`` (int64, broadcast against the entries)."""
        # The step's word: steps taken times 0x9E3779B9 (odd: distinct for 2**32 steps, and far
        # apart for neighbouring ones), used as 0x9E3779B9 - 2**32 so the int64 product cannot overflow.
        word = ((rounds & _MASK32) * -0x61C88647) & _MASK32
        # Hashed twice: one round leaves a measurable correlation between a position's noise in one
        # step and the next (lag-1 correlation 0.0017 +- 0.0007 over 6M draws; twice: 0.0002).
        # The high 16 bits of the hash: the multiplications carry low bits up, so those mix best.
        return (_mix32(_mix32(self._base ^ word)) >> 16).to(torch.int32)

    def _split(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return entries[:self.width], entries[self.width:]

    def fill_(self, out: torch.Tensor, start: int, tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write the noise of positions ``start .. start + len(out)`` into int32 ``out`` (1-D)."""
        run_fill_plan(self.fill_plan(out, start, tables))

    def fill_plan(self, out: torch.Tensor, start: int,
                  tables: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        """``fill_`` as its xors, ``(a, b, out)`` views each, for ``run_fill_plan``: a caller that fills
        the same ``out`` from the same ``tables`` tensors at every step (a small model's kept buffer;
        eager ``tables`` are the same tensors at every step) makes the views once, not ~8 a step."""
        t, u = tables
        width, n, done = self.width, out.numel(), 0
        row, col = divmod(start, width)
        plan = []
        if col:                         # a partial first row
            head = min(n, width - col)
            plan.append((t[col:col + head], u[row:row + 1], out[:head]))
            done, row = head, row + 1
        full = (n - done) // width      # whole rows: one broadcast xor, (rows, 1) ^ (width,)
        if full:
            plan.append((u[row:row + full, None], t, out[done:done + full * width].view(full, width)))
            done, row = done + full * width, row + full
        if done < n:                    # a partial last row
            plan.append((t[:n - done], u[row:row + 1], out[done:]))
        return plan

    def advance(self, found_inf: torch.Tensor | None = None) -> None:
        """Count a step taken: +1, or ``1 - found_inf`` where the optimizer's kernel decided (device)."""
        if found_inf is None:
            self._counts.add_(self._ones)
        else:                           # 1 where stepped (a float or bool flag), into both counts
            self._counts.add_(found_inf.reshape(1).logical_not())
        if torch.compiler.is_compiling():
            self._batch = None      # a Python count in a graph would be a guard: hash afresh after it
        else:
            self._advances += 1

    def get_state(self) -> torch.Tensor:
        """int64 ``[seed low 32 bits, seed high 32 bits, steps taken]`` on the CPU (syncs)."""
        return torch.tensor([self.key[0], self.key[1], int(self.rounds)], dtype=torch.int64)

    def check_state(self, state: Any) -> None:
        """Raise ValueError unless ``state`` is one ``get_state`` made."""
        if not (isinstance(state, torch.Tensor) and state.dtype == torch.int64 and state.shape == (3,)):
            got = (f"{state.dtype} {tuple(state.shape)}" if isinstance(state, torch.Tensor)
                   else type(state).__name__)
            raise ValueError(f"the stochastic-rounding state must be 3 int64 (seed low, seed high, steps), "
                             f"got {got}: was it saved by an older mixprec or another recipe?")
        lo, hi, rounds = state.tolist()
        if not (0 <= lo <= _MASK32 and 0 <= hi <= _MASK32 and rounds >= 0):
            raise ValueError(f"the stochastic-rounding state {state.tolist()} is out of range")

    def set_state(self, state: torch.Tensor) -> None:
        self.check_state(state)
        lo, hi, rounds = state.tolist()
        self._seed(lo | hi << 32)      # drops the batch of tables: hashed afresh from these rounds
        self.rounds.fill_(rounds)

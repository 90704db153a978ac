"""Exact range statistics of tensors, accumulated on the device: the counting half of ``mixprec doctor``.

One :class:`RangeHistogram` summarises every value it is fed (across calls and steps) with

- ``count``, ``zeros``, ``nonfinite`` and ``amax`` (the largest finite magnitude);
- an exponent histogram: how many nonzero finite values have ``floor(log2|x|) == k``, for
  ``k = -127 .. 127`` (bin ``-127`` also holds fp32's subnormals, everything below ``2**-126``);
- for each of fp16, bf16, fp8 e4m3 and fp8 e5m2, a :class:`~mixprec.formats.RangeCounts`: how many
  values would be zero, flush to zero, become subnormal, stay normal, overflow, or were already
  non-finite. These equal ``formats.classify(x, fmt)`` value for value (the tests check it), at a
  fraction of its cost.

How, exactly and cheaply: for positive floats the fp32 bit pattern orders like the value, so |x| is
read as an int32 once. Its exponent field is the histogram bin. Each format's buckets are intervals of
|x| whose ends (:func:`format_thresholds`) are found once by bisection over fp32 bit patterns with
``formats.quantize`` itself, so "rounds to zero", "rounds below min_normal" and "rounds above max"
(ties to even included) mean here exactly what they mean there. Each value lands in one of 270 bins,
each inside one binade and one bucket of every format (:mod:`.range_bins`: the exponent field plus
one compare per end, in one compiled kernel on a GPU and in C on a CPU (:mod:`.range_native`), or an
eager table lookup where nothing compiles); the count per bin gives the exponent histogram and all
the format counts.
:meth:`RangeHistogram.add_segments` counts many small tensors with the kernels of one. Everything
stays on the device until :meth:`RangeHistogram.result` reads it back (one host sync).

    >>> h = RangeHistogram("cpu")
    >>> h.add(torch.tensor([0.0, 1e-8, 1e-6, 1.0, 7e4, float("inf")]))
    >>> r = h.result()
    >>> r.formats["fp16"]
    RangeCounts(zero=1, flush=1, subnormal=1, normal=1, overflow=1, nonfinite=1)
    >>> r.exponent_counts()[0], r.amax
    (1, 70000.0)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from ..formats import RangeCounts
from .range_bins import N_BINS, RANGE_FORMATS, bin_tables, boundaries, count_piece, format_thresholds
from .range_native import count_native, native_counter

__all__ = ["RANGE_FORMATS", "EXP_MIN", "EXP_MAX", "RangeHistogram", "TensorStats", "format_thresholds"]

EXP_MIN, EXP_MAX = -127, 127    # floor(log2|x|) of fp32's finite nonzero values; -127 lumps subnormals
_PIECE = 1 << 19                # elements per pass of RangeHistogram.add (stays in cache)


@dataclasses.dataclass(frozen=True)
class TensorStats:
    """What a :class:`RangeHistogram` saw, read back as plain numbers (goes into JSON as it is).

    ``exponents`` holds ``(k, count)`` for each exponent ``k = floor(log2|x|)`` with a nonzero count,
    ascending; ``formats`` maps a format name (``"fp16"``, ...) to its exact :class:`RangeCounts`.
    """

    count: int
    zeros: int
    nonfinite: int
    amax: float
    exponents: tuple[tuple[int, int], ...]
    formats: dict[str, RangeCounts]

    def exponent_counts(self) -> dict[int, int]:
        """``{k: n}``: ``n`` nonzero finite values with ``floor(log2|x|) == k``."""
        return dict(self.exponents)

    def fraction(self, fmt: str, bucket: str) -> float:
        """``formats[fmt].<bucket>`` as a fraction of all values counted (0.0 when none were)."""
        return getattr(self.formats[fmt], bucket) / self.count if self.count else 0.0

    def fraction_below(self, threshold_exp: int) -> float:
        """Fraction of the *nonzero finite* values with ``|x| < 2**threshold_exp`` (exact: bins end there)."""
        live = self.count - self.zeros - self.nonfinite
        small = sum(n for k, n in self.exponents if k < threshold_exp)
        return small / live if live else 0.0

    @staticmethod
    def merge(stats: list[TensorStats]) -> TensorStats | None:
        """One TensorStats summing several (amax the largest); None for an empty list."""
        if not stats:
            return None
        exps: dict[int, int] = {}
        for s in stats:
            for k, n in s.exponents:
                exps[k] = exps.get(k, 0) + n
        formats = {name: RangeCounts(*[sum(getattr(s.formats[name], f.name) for s in stats)
                                       for f in dataclasses.fields(RangeCounts)])
                   for name in stats[0].formats}
        return TensorStats(count=sum(s.count for s in stats), zeros=sum(s.zeros for s in stats),
                           nonfinite=sum(s.nonfinite for s in stats), amax=max(s.amax for s in stats),
                           exponents=tuple(sorted(exps.items())), formats=formats)


def count_values(x: torch.Tensor, scale: torch.Tensor | None, runs: tuple[int, ...],
                 fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.range_bins.count_piece`'s counts and amaxes, by the device's route.

    ``fused`` on a CPU: ``range_count.c`` (:mod:`.range_native`), or the eager route where it cannot be
    built; on other devices the compiled kernel. ``fused=False``: eager torch ops.
    """
    if fused and x.device.type == "cpu":
        if native_counter() is not None:
            return count_native(x, scale, runs)
        fused = False
    return count_piece(x, scale, runs, fused)


class RangeHistogram:
    """Accumulates exact range statistics of every tensor passed to :meth:`add`, on ``device``.

    ``add`` launches a handful of kernels and never syncs with the host; ``result`` syncs once.
    ``fused=False`` counts with eager torch ops only; ``True`` with the device's one-pass counter (the
    same numbers; see :func:`count_values`).
    """

    def __init__(self, device: torch.device | str, fused: bool = True) -> None:
        self.device = torch.device(device)
        self.fused = fused
        self._bins = torch.zeros(N_BINS, dtype=torch.int64, device=self.device)
        self._amax = torch.zeros((), dtype=torch.float32, device=self.device)
        self.tensors = 0   # how many tensors were added (a Python int: no sync)

    def add(self, x: torch.Tensor, scale: torch.Tensor | None = None,
            keep: torch.Tensor | None = None) -> None:
        """Count the values of ``x`` (any float dtype), multiplied by ``scale`` first if given. No sync.

        ``scale`` is a () fp32 device tensor, e.g. ``1 / S`` to bring loss-scaled gradients back to
        true units: exact when S is a power of two and the result stays an fp32 normal. fp16, bf16 and
        fp8 values are exact in fp32; float64 input is rounded to fp32 first. ``keep``, a () bool
        device tensor, counts ``x`` only where it is True (deciding on the device, without a sync).
        """
        x = x.detach().reshape(-1)
        weight = None if keep is None else keep.to(torch.int64)
        # Pieces of 2**19 values: see add_segments.
        for start in range(0, x.numel(), _PIECE):
            piece = x[start:start + _PIECE]
            counts, finite_max = count_values(piece, scale, (piece.numel(),), self.fused)
            self._bins += counts if weight is None else counts * weight
            if keep is not None:
                finite_max = torch.where(keep, finite_max, 0.0)
            torch.maximum(self._amax, finite_max[0], out=self._amax)
        self.tensors += 1

    @staticmethod
    def add_segments(hists: Sequence[RangeHistogram], flat: torch.Tensor, sizes: Sequence[int],
                     scale: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> None:
        """Count consecutive segments of one tensor: the first ``sizes[0]`` values into ``hists[0]``, ... No sync.

        The same numbers as ``hists[i].add(segment_i, scale, keep)`` for each ``i``, for a fixed number
        of kernels per 2**19 values plus two per histogram, however small the segments: the collector
        counts all weights (gradients, updates) of a step with one call. A histogram may appear more
        than once. The route (fused or eager) is ``hists[0]``'s.

            >>> a, b = RangeHistogram("cpu"), RangeHistogram("cpu")
            >>> RangeHistogram.add_segments([a, b], torch.tensor([0.0, 1.0, 2.0**-30]), [2, 1])
            >>> a.result().zeros, b.result().formats["fp16"].flush
            (1, 1)
        """
        flat = flat.detach().reshape(-1)
        if len(hists) != len(sizes) or sum(sizes) != flat.numel():
            raise ValueError(f"add_segments needs one size per histogram summing to the tensor's "
                             f"{flat.numel()} values; got {len(sizes)} sizes summing to {sum(sizes)} "
                             f"for {len(hists)} histograms")
        for h in hists:
            h.tensors += 1
        live = [(h, n) for h, n in zip(hists, sizes) if n]   # empty segments count nothing
        if not live:
            return
        hists, sizes = [h for h, _ in live], [n for _, n in live]
        device, fused = hists[0].device, hists[0].fused
        if len(hists) == 1:     # straight into the histogram
            bins, amax = hists[0]._bins, hists[0]._amax.view(1)
        else:                   # one row per histogram, handed out at the end
            bins = torch.zeros(len(hists) * N_BINS, dtype=torch.int64, device=device)
            amax = torch.zeros(len(hists), dtype=torch.float32, device=device)
        weight = None if keep is None else keep.to(torch.int64)
        ends = list(itertools.accumulate(sizes))
        first = 0
        # Piece by piece: pieces of 2**19 values keep the eager route's passes over each in cache.
        for start in range(0, flat.numel(), _PIECE):
            stop = min(start + _PIECE, flat.numel())
            while ends[first] <= start:          # the first segment in the piece
                first += 1
            last = first
            while ends[last] < stop:             # the last one
                last += 1
            runs = tuple(min(ends[i], stop) - max(ends[i - 1] if i else 0, start)
                         for i in range(first, last + 1))
            counts, finite_max = count_values(flat[start:stop], scale, runs, fused)
            bins[first * N_BINS:(last + 1) * N_BINS] += counts if weight is None else counts * weight
            if keep is not None:
                finite_max = torch.where(keep, finite_max, 0.0)
            torch.maximum(amax[first:last + 1], finite_max, out=amax[first:last + 1])
        if len(hists) > 1:     # two foreach calls, not two ops per histogram (one may appear twice)
            rows = bins.view(len(hists), N_BINS).unbind()
            for part in _distinct_parts(hists):
                torch._foreach_add_([hists[i]._bins for i in part], [rows[i] for i in part])
                torch._foreach_maximum_([hists[i]._amax for i in part], [amax[i] for i in part])

    def result(self) -> TensorStats:
        """Everything counted so far as plain numbers. One host sync."""
        _, bin_exponent, bin_bucket = bin_tables()
        ends, starts = boundaries()
        bins = self._bins.cpu()
        buckets = torch.zeros(len(ends) + 1, dtype=torch.int64)
        buckets = buckets.index_add_(0, bin_bucket, bins).tolist()
        exponents = torch.zeros(256, dtype=torch.int64).index_add_(0, bin_exponent, bins).tolist()
        amax = float(self._amax)
        total = sum(buckets)
        zeros = buckets[0]
        formats = {}
        for name, (flush, sub, normal, over, nonfinite) in starts.items():
            part = lambda a, b: sum(buckets[a:b])   # noqa: E731 - buckets a..b-1
            formats[name] = RangeCounts(zero=zeros, flush=part(flush, sub), subnormal=part(sub, normal),
                                        normal=part(normal, over), overflow=part(over, nonfinite),
                                        nonfinite=part(nonfinite, len(buckets)))
        nonfinite = formats[RANGE_FORMATS[0].name].nonfinite
        # Field 0 holds the zeros and fp32's subnormals (floor(log2) <= -127): keep the subnormals.
        exponents[0] -= zeros
        pairs = tuple((field - 127, n) for field, n in enumerate(exponents[:255]) if n)
        return TensorStats(count=total, zeros=zeros, nonfinite=nonfinite, amax=amax, exponents=pairs,
                           formats=formats)


def _distinct_parts(hists: Sequence[RangeHistogram]) -> list[list[int]]:
    """Indices of ``hists`` in groups where no histogram appears twice (a foreach op writes each once)."""
    parts: list[list[int]] = []
    seen: list[set[int]] = []
    for i, h in enumerate(hists):
        for part, ids in zip(parts, seen):
            if id(h) not in ids:
                part.append(i)
                ids.add(id(h))
                break
        else:
            parts.append([i])
            seen.append({id(h)})
    return parts

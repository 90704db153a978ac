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
(ties to even included) mean here exactly what they mean there. Every end, and every binade start,
is a multiple of 4096 or one above one, so each value needs one lookup in a 2**19-entry table (its
bits >> 12) plus one bit (are its low 12 bits zero?) to land in one of 542 bins, each inside one
binade and one bucket of every format; one ``bincount`` of the bins gives the exponent histogram and
all the format counts (:func:`_bin_tables_cpu`). About eight passes per value, in pieces that stay in
cache, and :meth:`RangeHistogram.add_segments` counts many small tensors with the kernels of one.
Everything stays on the device until :meth:`RangeHistogram.result` reads it back (one host sync).

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
import functools
import itertools
from collections.abc import Sequence

import torch

from ..formats import BF16, FP8_E4M3, FP8_E5M2, FP16, Format, RangeCounts, quantize

__all__ = ["RANGE_FORMATS", "EXP_MIN", "EXP_MAX", "RangeHistogram", "TensorStats", "format_thresholds"]

RANGE_FORMATS: tuple[Format, ...] = (FP16, BF16, FP8_E4M3, FP8_E5M2)
EXP_MIN, EXP_MAX = -127, 127    # floor(log2|x|) of fp32's finite nonzero values; -127 lumps subnormals
_N_EXP = EXP_MAX - EXP_MIN + 1
_ABS_MASK = 0x7FFFFFFF          # clears the sign bit of an fp32 pattern
_INF_BITS = 0x7F800000          # +inf; every pattern above it is a NaN
_MAX_FINITE_BITS = 0x7F7FFFFF   # fp32 max


def _first_bits(pred) -> int:
    """The smallest positive fp32 bit pattern ``b`` for which ``pred(value of b)`` holds (pred monotone).

    Bisection over [1, +inf bits]: 31 steps, each one ``quantize`` of a single value.
    """
    lo, hi = 1, _INF_BITS          # pred(hi) is assumed True (inf is past every threshold)
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(torch.tensor([mid], dtype=torch.int32).view(torch.float32)):
            hi = mid
        else:
            lo = mid + 1
    return lo


@functools.cache
def format_thresholds(fmt: Format) -> tuple[int, int, int]:
    """fp32 bit patterns where |x| starts to round to a nonzero value, to a normal one, to overflow.

    For fp16 these are the patterns of ``2**-25`` plus one fp32 ulp (``2**-25`` itself ties to the
    even zero), ``2**-14 - 2**-25`` (the tie between the largest subnormal and ``min_normal`` goes to
    the even ``min_normal``) and ``65520`` (the tie above 65504 goes to inf). Found with
    :func:`~mixprec.formats.quantize` itself, so they agree with ``classify`` by construction.
    Computed once per format (cached), on the CPU.

        >>> [torch.tensor(b, dtype=torch.int32).view(torch.float32).item() for b in format_thresholds(FP16)]
        [2.980232594040899e-08, 6.1005353927612305e-05, 65520.0]
    """
    nonzero = _first_bits(lambda v: bool(quantize(v, fmt)[0] != 0))
    normal = _first_bits(lambda v: bool(quantize(v, fmt)[0].abs() >= fmt.min_normal))
    overflow = _first_bits(lambda v: not bool(torch.isfinite(quantize(v, fmt)[0])))
    return nonzero, normal, overflow


@functools.cache
def _boundaries_cpu() -> tuple[torch.Tensor, dict[str, tuple[int, int, int, int, int]]]:
    """Sorted int32 bucket ends: 1 (nonzero), every format's three thresholds, +inf (non-finite).

    Returns the ends and, per format, the bucket indices where its flush, subnormal, normal,
    overflow and non-finite ranges begin (zero is bucket 0).
    """
    ends = {1, _INF_BITS}
    for fmt in RANGE_FORMATS:
        ends.update(format_thresholds(fmt))
    ordered = sorted(ends)
    # With right=True, bucketize puts b in bucket i when ordered[i-1] <= b < ordered[i]: values at or
    # above an end belong to the bucket that starts there, bucket index ordered.index(end) + 1.
    starts = {fmt.name: (1, *(ordered.index(t) + 1 for t in format_thresholds(fmt)),
                         ordered.index(_INF_BITS) + 1)
              for fmt in RANGE_FORMATS}
    return torch.tensor(ordered, dtype=torch.int32), starts


_CHUNK_SHIFT = 12                 # the lookup table is indexed by |x|'s bits >> 12: 2**19 entries
_LOW_MASK = (1 << _CHUNK_SHIFT) - 1
_PIECE = 1 << 19                  # elements per pass of RangeHistogram.add (stays in cache)


@functools.cache
def _bin_tables_cpu() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tables behind :meth:`RangeHistogram.add`: one bin per element replaces bucketize + two counts.

    The fp32 patterns 0 .. 2**31 are cut into regions at every binade start (``k << 23``) and at every
    bucket end; all cuts are multiples of 4096, so ``lut[b >> 12]`` finds ``b``'s region with one
    gather. Ends that are not multiples of 4096 are all of the form ``P + 1`` (``P`` a multiple of
    4096: ``|x| > P`` is what "does not round to zero" means at a tie that goes to the even zero), so
    ``P`` and ``P + 4096`` are cuts, and the bit ``t = (b & 4095) != 0`` splits that one-chunk region
    into ``{P}`` and ``(P, P + 4096)``. An element's bin is ``2 * region + t``. Every bin lies inside
    one binade and on one side of every end, so the counts per bin add up exactly to the exponent
    histogram and to every format's buckets (its first member ``region_start + t`` tells which).

    Returns ``lut`` (int32, ``2 * region`` per chunk), and per bin its fp32 exponent field and its
    bucket index (as :func:`_boundaries_cpu` numbers them). Built once, on the CPU.
    """
    ends, _ = _boundaries_cpu()
    cuts = {k << 23 for k in range(256)}
    for end in ends.tolist():
        if end & _LOW_MASK == 0:
            cuts.add(end)
        elif (end - 1) & _LOW_MASK == 0:
            cuts.update((end - 1, end - 1 + (1 << _CHUNK_SHIFT)))
        else:    # no format here has one; a new format would need a finer table
            raise ValueError(f"bucket end {end:#x} is neither a multiple of 4096 nor one above one")
    starts = torch.tensor(sorted(cuts), dtype=torch.int32)
    chunks = torch.arange(1 << (31 - _CHUNK_SHIFT), dtype=torch.int32) << _CHUNK_SHIFT
    lut = (torch.bucketize(chunks, starts, right=True) - 1).to(torch.int32) * 2
    first = torch.stack([starts, starts + 1], dim=1).reshape(-1)     # bin 2r + t's smallest member
    return lut, first >> 23, torch.bucketize(first, ends, right=True)


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


class RangeHistogram:
    """Accumulates exact range statistics of every tensor passed to :meth:`add`, on ``device``.

    ``add`` launches a handful of kernels and never syncs with the host; ``result`` syncs once.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        _, self._starts = _boundaries_cpu()
        self._lut = _device_lut(self.device)
        self._bins = torch.zeros(len(_bin_tables_cpu()[1]), dtype=torch.int64, device=self.device)
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
            mag, index = _bin_index(self._lut, x[start:start + _PIECE], scale)
            counts = _bincount(index, len(self._bins))
            self._bins += counts if weight is None else counts * weight
            finite_max = mag.nan_to_num_(nan=0.0, posinf=0.0).amax()   # the largest *finite* |x|
            if keep is not None:
                finite_max = torch.where(keep, finite_max, 0.0)
            torch.maximum(self._amax, finite_max, out=self._amax)
        self.tensors += 1

    @staticmethod
    def add_segments(hists: Sequence[RangeHistogram], flat: torch.Tensor, sizes: Sequence[int],
                     scale: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> None:
        """Count consecutive segments of one tensor: the first ``sizes[0]`` values into ``hists[0]``, ... No sync.

        The same numbers as ``hists[i].add(segment_i, scale, keep)`` for each ``i``, for a fixed number
        of kernels per 2**19 values plus two per histogram, however small the segments: the collector
        counts all weights (gradients, updates) of a step with one call.

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
        n_bins, device = len(hists[0]._bins), hists[0].device
        if len(hists) == 1:     # straight into the histogram
            bins, amax = hists[0]._bins, hists[0]._amax.view(1)
        else:                   # one row per histogram, handed out at the end
            bins = torch.zeros(len(hists) * n_bins, dtype=torch.int64, device=device)
            amax = torch.zeros(len(hists), dtype=torch.float32, device=device)
        weight = None if keep is None else keep.to(torch.int64)
        ends = list(itertools.accumulate(sizes))
        first = 0
        # Piece by piece through three scratch buffers, reused across calls: fresh 4-byte-per-element
        # temporaries cost the CPU more in page faults than the arithmetic, and pieces of 2**19
        # elements keep the seven passes over each piece in cache.
        for start in range(0, flat.numel(), _PIECE):
            stop = min(start + _PIECE, flat.numel())
            while ends[first] <= start:          # the first segment in the piece
                first += 1
            last = first
            while ends[last] < stop:             # the last one
                last += 1
            runs = tuple(min(ends[i], stop) - max(ends[i - 1] if i else 0, start)
                         for i in range(first, last + 1))
            mag, index = _bin_index(hists[0]._lut, flat[start:stop], scale)
            if len(runs) > 1:
                index += _run_offsets(runs, n_bins, device)   # segment i's bins come i * n_bins later
            counts = _bincount(index, len(runs) * n_bins)
            bins[first * n_bins:(last + 1) * n_bins] += counts if weight is None else counts * weight
            mag.nan_to_num_(nan=0.0, posinf=0.0)                # the largest *finite* |x| per segment
            if len(runs) == 1:
                finite_max = mag.amax().view(1)
            else:
                finite_max = torch.stack(torch._foreach_max(mag.split(runs)))
            if keep is not None:
                finite_max = torch.where(keep, finite_max, 0.0)
            torch.maximum(amax[first:last + 1], finite_max, out=amax[first:last + 1])
        if len(hists) > 1:
            for i, h in enumerate(hists):
                h._bins += bins[i * n_bins:(i + 1) * n_bins]
                torch.maximum(h._amax, amax[i], out=h._amax)

    def result(self) -> TensorStats:
        """Everything counted so far as plain numbers. One host sync."""
        _, bin_exponent, bin_bucket = _bin_tables_cpu()
        bins = self._bins.cpu()
        buckets = torch.zeros(len(_boundaries_cpu()[0]) + 1, dtype=torch.int64)
        buckets = buckets.index_add_(0, bin_bucket, bins).tolist()
        exponents = torch.zeros(256, dtype=torch.int64).index_add_(0, bin_exponent, bins).tolist()
        amax = float(self._amax)
        total = sum(buckets)
        zeros = buckets[0]
        formats = {}
        for name, (flush, sub, normal, over, nonfinite) in self._starts.items():
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


def _bin_index(lut: torch.Tensor, x: torch.Tensor,
               scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``|x * scale|`` in fp32 and each value's bin (see :func:`_bin_tables_cpu`), in scratch buffers."""
    mag, hi, index = _scratch(lut.device, x.numel())
    if x.dtype == torch.float32:           # one pass fewer: straight into the buffer
        torch.abs(x, out=mag) if scale is None else torch.mul(x, scale, out=mag).abs_()
    else:
        mag.copy_(x)                       # to fp32: exact for fp16/bf16/fp8, rounds float64
        if scale is not None:
            mag.mul_(scale)                # in fp32, after the conversion (fp16 would underflow)
        mag.abs_()
    # |x| as an int32 that orders like the value; NaN patterns land above +inf's.
    bits = mag.view(torch.int32)
    torch.bitwise_right_shift(bits, _CHUNK_SHIFT, out=hi)
    torch.index_select(lut, 0, hi, out=index)               # 2 * region
    torch.bitwise_and(bits, _LOW_MASK, out=hi)
    hi.add_(_LOW_MASK).bitwise_right_shift_(_CHUNK_SHIFT)   # 1 where the low 12 bits are not all 0
    index += hi
    return mag, index


def _bincount(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0 .. n-1 occurs in ``index`` (int64). No sync on CUDA, where bincount would."""
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=n)
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(
        0, index.long(), torch.ones_like(index, dtype=torch.int64))


_OFFSETS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _run_offsets(runs: tuple[int, ...], n_bins: int, device: torch.device) -> torch.Tensor:
    """int32 ``i * n_bins`` repeated ``runs[i]`` times; cached (a model's layout repeats every step)."""
    key = (device, runs)
    if key not in _OFFSETS:
        if len(_OFFSETS) > 256:
            _OFFSETS.clear()
        starts = torch.arange(len(runs), dtype=torch.int32) * n_bins
        _OFFSETS[key] = starts.repeat_interleave(torch.tensor(runs)).to(device)
    return _OFFSETS[key]


_LUTS: dict[torch.device, torch.Tensor] = {}
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per device: an fp32 and two int32 work buffers of length ``n``, views of buffers that grow to
    the largest piece counted so far (at most 2**19 values: 6 MiB, kept for the process's life).

    Shared by every histogram on the device: ``add`` uses them only within one call, and calls on
    one device are issued one after another (on CUDA, in stream order). No sync.
    """
    bufs = _SCRATCH.get(device)
    if bufs is None or bufs[0].numel() < n:
        bufs = (torch.empty(n, dtype=torch.float32, device=device),
                torch.empty(n, dtype=torch.int32, device=device),
                torch.empty(n, dtype=torch.int32, device=device))
        _SCRATCH[device] = bufs
    return bufs[0][:n], bufs[1][:n], bufs[2][:n]


def _device_lut(device: torch.device) -> torch.Tensor:
    """The 2 MiB region table of :func:`_bin_tables_cpu` on ``device``, copied there once."""
    if device not in _LUTS:
        _LUTS[device] = _bin_tables_cpu()[0].to(device)
    return _LUTS[device]

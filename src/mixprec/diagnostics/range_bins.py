"""Which bin each value falls in: the bins behind :class:`~.range_histogram.RangeHistogram`, and the two
routes that compute them, one fused and one eager, equal bin for bin.

**The bins.** Read ``|x|`` as an int32: for nonnegative floats the pattern orders like the value. Cut the
patterns ``0 .. 2**31 - 1`` at every binade start (``k << 23``) and at every *end*: where a format's
bucket changes (:func:`format_thresholds`: starts to round to nonzero, to a normal, to overflow), where
nonzero starts (1) and where non-finite starts (+inf's pattern). Between two cuts all values share one
fp32 exponent and one bucket of every format. Name the piece of ``bits`` by ``e + b``, with
``e = bits >> 23`` (the exponent field) and ``b`` the number of ends ``<= bits`` (its bucket, numbered
as :func:`boundaries` numbers them). Both only grow with ``bits`` and each cut raises one of them, so
``e + b`` names each piece once: :data:`N_BINS` ``= 256 + len(ends)`` bins (a cut that is both a
binade start and an end skips a number; that bin stays empty). Per bin, :func:`bin_tables` keeps its
exponent field and bucket: counts per bin add up exactly to the exponent histogram and the buckets.

**The fused route** (:func:`count_piece` with ``fused=True``): ``(bits >> 23)`` plus one compare per end
(14), and the largest finite ``|x|`` in the same pass: one elementwise kernel under ``torch.compile``
(Triton on a GPU; :class:`~mixprec.fusion.FusedFunction`, compiled once per input dtype), then one
count of the bins. Where compiling fails it warns once and the eager route takes over. A CPU counts
with the same arithmetic in C instead (:mod:`.range_native`: Inductor's C++ build takes seconds and
torch's ``bincount`` is a serial loop that scans its input twice first).

**The eager route**: the ends that are not multiples of 4096 are all one above one (``P + 1``: "does not
round to zero" is ``|x| > P`` at a tie that goes to the even zero), so one 2**19-entry table indexed by
``bits >> 12`` holds ``2 * bin + special`` for each 4096-pattern chunk (``special``: ``P + 1`` is an
end), and ``(table + t) >> 1``, with ``t = 1`` where the low 12 bits are not all zero, is the bin:
``bin`` throughout an ordinary chunk, and in a special one ``bin`` for ``P`` itself and ``bin + 1``
above it. About ten eager passes per value, in pieces that stay in cache.

Below: zero (exponent field 0, bucket 0); 1.0 and -1.5 share a bin (field 127, above 9 of the 14 ends);
NaN is in the last bin (field 255, above every end).

    >>> counts, amax = count_piece(torch.tensor([0.0, 1.0, -1.5, float("nan")]), None, (4,), fused=False)
    >>> exponent, bucket = bin_tables()[1:]
    >>> [(int(exponent[i]), int(bucket[i]), int(counts[i])) for i in counts.nonzero().flatten().tolist()]
    [(0, 0, 1), (127, 9, 2), (255, 14, 1)]
    >>> amax
    tensor([1.5000])
"""

from __future__ import annotations

import functools

import torch

from ..formats import BF16, FP8_E4M3, FP8_E5M2, FP16, Format, quantize
from ..fusion import FusedFunction

__all__ = ["RANGE_FORMATS", "N_BINS", "boundaries", "bin_tables", "count_piece", "format_thresholds",
           "fused_binning"]

RANGE_FORMATS: tuple[Format, ...] = (FP16, BF16, FP8_E4M3, FP8_E5M2)
_ABS_MASK = 0x7FFFFFFF          # clears the sign bit of an fp32 pattern
_INF_BITS = 0x7F800000          # +inf; every pattern above it is a NaN
_CHUNK_SHIFT = 12               # the eager table is indexed by |x|'s bits >> 12: 2**19 entries
_LOW_MASK = (1 << _CHUNK_SHIFT) - 1
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # others go to fp32 first (exact for fp8)


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
def boundaries() -> tuple[tuple[int, ...], dict[str, tuple[int, int, int, int, int]]]:
    """The sorted ends: 1 (nonzero), every format's three thresholds, +inf (non-finite); 14 today.

    Returns the ends and, per format, the buckets where its flush, subnormal, normal, overflow and
    non-finite ranges begin (zero is bucket 0; bucket ``i`` holds the patterns with ``i`` ends at or
    below them).
    """
    ends = {1, _INF_BITS}
    for fmt in RANGE_FORMATS:
        ends.update(format_thresholds(fmt))
    ordered = tuple(sorted(ends))
    starts = {fmt.name: (1, *(ordered.index(t) + 1 for t in format_thresholds(fmt)),
                         ordered.index(_INF_BITS) + 1)
              for fmt in RANGE_FORMATS}
    return ordered, starts


N_BINS = 256 + 14    # 256 exponent fields + len(boundaries()[0]); bin_tables checks it


@functools.cache
def bin_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager route's table, and per bin its fp32 exponent field and its bucket. Built once, on the CPU.

    Returns ``lut`` (int32, ``2 * bin + special`` per 4096-pattern chunk; see the module docstring),
    ``bin_exponent`` and ``bin_bucket`` (int64, :data:`N_BINS` each; 0 for the numbers no bin takes).
    """
    ends_list, _ = boundaries()
    if 256 + len(ends_list) != N_BINS:
        raise AssertionError(f"N_BINS is {N_BINS} but there are {len(ends_list)} ends")
    ends = torch.tensor(ends_list, dtype=torch.int64)
    special = torch.zeros(1 << (31 - _CHUNK_SHIFT), dtype=torch.int32)
    for end in ends_list:
        if end & _LOW_MASK == 1:
            special[end >> _CHUNK_SHIFT] = 1
        elif end & _LOW_MASK:    # no format here has one; a new format would need a finer table
            raise ValueError(f"bucket end {end:#x} is neither a multiple of 4096 nor one above one")
    chunks = torch.arange(1 << (31 - _CHUNK_SHIFT), dtype=torch.int64) << _CHUNK_SHIFT
    lut = ((chunks >> 23) + torch.bucketize(chunks, ends, right=True)).to(torch.int32) * 2 + special
    cuts = torch.tensor(sorted({0, *(k << 23 for k in range(256)), *ends_list}), dtype=torch.int64)
    bucket = torch.bucketize(cuts, ends, right=True)           # ends <= cut
    bins = (cuts >> 23) + bucket
    bin_exponent = torch.zeros(N_BINS, dtype=torch.int64).index_copy_(0, bins, cuts >> 23)
    bin_bucket = torch.zeros(N_BINS, dtype=torch.int64).index_copy_(0, bins, bucket)
    return lut, bin_exponent, bin_bucket


_ENDS: tuple[int, ...] = ()    # boundaries()[0], set by fused_binning before it compiles anything


def _compare_bins(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each value's bin into ``out`` (int32); returns the finite ``|x * scale|`` as int32 bits (0 if not).

    ``x.float() * scale`` is the eager route's fp32 product (exact conversion, then one rounding);
    clearing the sign bit is ``abs``. ``(end - 1 - bits) >> 31`` is -1 where ``bits >= end`` and 0
    below (both are below 2**31: no overflow), so subtracting it counts the ends at or below ``bits``
    in three integer ops per end. Written for torch.compile: one elementwise kernel that writes
    straight into ``out`` (a reused buffer: no fresh allocation per call). The ends come from a
    module global because torch.compile bakes a global tuple of ints into the kernel as constants,
    where ``dynamic=True`` would make closure or argument ints symbolic (a slower kernel).
    """
    bins, finite = _bins_and_finite(x, scale)
    out.copy_(bins)
    return finite


def _bins_and_finite(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_compare_bins` without the write: each value's bin (int32) and its finite ``|x * scale|``'s bits."""
    bits = (x.float() * scale).view(torch.int32) & _ABS_MASK
    bins = bits >> 23
    for end in _ENDS:
        bins = bins - ((end - 1 - bits) >> 31)
    return bins, torch.where(bits < _INF_BITS, bits, 0)


def _fused_one(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One run: bins into ``out``; returns the largest finite ``|x * scale|`` (() fp32; int max = float max)."""
    return _compare_bins(x, scale, out).amax().view(torch.float32)


def _fused_runs(x: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                finite_out: torch.Tensor) -> None:
    """Several runs: bins shifted to each run's row into ``out``, finite magnitudes' bits into ``finite_out``."""
    finite_out.copy_(_compare_bins(x, scale, out))
    out.add_(offsets)


@functools.cache
def fused_binning() -> tuple[FusedFunction, FusedFunction]:
    """The compiled routes for one run and for several, made on first use (``broken`` says why not)."""
    global _ENDS
    _ENDS = boundaries()[0]     # found here, before anything is traced
    return FusedFunction(_fused_one, "range binning"), FusedFunction(_fused_runs, "range binning (runs)")


def count_piece(x: torch.Tensor, scale: torch.Tensor | None, runs: tuple[int, ...],
                fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Bin counts and largest finite ``|x * scale|`` of the consecutive runs of the 1-D ``x``. No sync.

    Returns int64 counts, :data:`N_BINS` per run one after another, and fp32 amaxes, one per run (runs
    are not empty). Both routes give the same numbers; ``fused=False`` and a fused route that failed to
    compile are eager. (On a CPU the histogram counts with :mod:`.range_native` instead; this compiled
    route is what a GPU runs, and what the CPU tests compile to check it.)
    """
    one, many = fused_binning()
    if fused and one.broken is None and many.broken is None:
        if x.dtype not in _FUSED_DTYPES:
            x = x.float()                        # exact for fp8; float64 rounds, as the eager route does
        s = _one(x.device) if scale is None else scale.float()    # x * 1 is x, subnormals included
        finite, _, index = _scratch(x.device, x.numel())
        finite = finite.view(torch.int32)
        # Fixed grad and autocast modes: one compiled graph whether called in forward, backward or step.
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            if len(runs) == 1:
                amax = one(x, s, index).view(1)
            else:
                many(x, s, _run_offsets(runs, x.device), index, finite)
                amax = torch.stack(torch._foreach_max(finite.split(runs))).view(torch.float32)
    else:
        mag, index = _eager_bins(x, scale)
        if len(runs) > 1:
            index += _run_offsets(runs, x.device)
        mag.nan_to_num_(nan=0.0, posinf=0.0)     # the largest *finite* |x|
        amax = mag.amax().view(1) if len(runs) == 1 else torch.stack(torch._foreach_max(mag.split(runs)))
    return _bincount(index, len(runs) * N_BINS), amax


def _eager_bins(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``|x * scale|`` in fp32 and each value's bin by the table, in scratch buffers."""
    mag, hi, index = _scratch(x.device, x.numel())
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
    torch.index_select(_device_lut(x.device), 0, hi, out=index)   # 2 * bin + special
    torch.bitwise_and(bits, _LOW_MASK, out=hi)
    hi.add_(_LOW_MASK).bitwise_right_shift_(_CHUNK_SHIFT)         # 1 where the low 12 bits are not all 0
    index.add_(hi).bitwise_right_shift_(1)
    return mag, index


def _bincount(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0 .. n-1 occurs in ``index`` (int64). No sync on CUDA, where bincount would."""
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=n)
    return _index_add_count(index, n)


def _index_add_count(index: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`_bincount` as one ``index_add_`` of a broadcast 1 (int32 indices as they are: no int64
    copy of the index and no tensor of ones, 12 bytes per value less memory traffic). No sync."""
    one = _ONES_I64.get(index.device)
    if one is None:
        one = _ONES_I64[index.device] = torch.ones((), dtype=torch.int64, device=index.device)
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(0, index, one.expand(index.numel()))


_OFFSETS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
_ONES: dict[torch.device, torch.Tensor] = {}
_ONES_I64: dict[torch.device, torch.Tensor] = {}
_LUTS: dict[torch.device, torch.Tensor] = {}
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _run_offsets(runs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 ``i * N_BINS`` repeated ``runs[i]`` times; cached (a model's layout repeats every step)."""
    key = (device, runs)
    if key not in _OFFSETS:
        if len(_OFFSETS) > 256:
            _OFFSETS.clear()
        starts = torch.arange(len(runs), dtype=torch.int32) * N_BINS
        _OFFSETS[key] = starts.repeat_interleave(torch.tensor(runs)).to(device)
    return _OFFSETS[key]


def _one(device: torch.device) -> torch.Tensor:
    """A () fp32 1.0 on ``device``, made once (the fused route always multiplies by a scale)."""
    if device not in _ONES:
        _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _ONES[device]


def _scratch(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per device: an fp32 and two int32 work buffers of length ``n``, views of buffers that grow to
    the largest piece counted so far (at most 2**19 values: 6 MiB, kept for the process's life).

    Shared by every histogram on the device: they are used only within one call, and calls on one
    device are issued one after another (on CUDA, in stream order). Fresh 4-byte-per-value
    temporaries cost the CPU more in page faults than the arithmetic. No sync.
    """
    bufs = _SCRATCH.get(device)
    if bufs is None or bufs[0].numel() < n:
        bufs = (torch.empty(n, dtype=torch.float32, device=device),
                torch.empty(n, dtype=torch.int32, device=device),
                torch.empty(n, dtype=torch.int32, device=device))
        _SCRATCH[device] = bufs
    return bufs[0][:n], bufs[1][:n], bufs[2][:n]


def _device_lut(device: torch.device) -> torch.Tensor:
    """The 2 MiB table of :func:`bin_tables` on ``device``, copied there once."""
    if device not in _LUTS:
        _LUTS[device] = bin_tables()[0].to(device)
    return _LUTS[device]

"""The doctor's counting routes and the small-tensor batch (range_batch): the CPU's C counter
(range_native), the compiled kernel a GPU runs (range_bins, compiled here by Inductor's C++ backend), the
eager table route and the batch all give formats.classify's counts, value for value, on the values where
it is easiest to be wrong. The compiled graphs are tiny (one elementwise kernel each)."""

import contextlib
import math
import tempfile
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.diagnostics import range_batch, range_bins, range_histogram, range_native
from mixprec.diagnostics.range_batch import SmallTensorBatch
from mixprec.diagnostics.range_bins import (N_BINS, RANGE_FORMATS, bin_tables, boundaries, count_piece,
                                            format_thresholds, fused_binning)
from mixprec.diagnostics.range_collector import RangeCollector, update_lost
from mixprec.diagnostics.range_histogram import RangeHistogram
from mixprec.formats import classify
from mixprec.fusion import FusionWarning

from conftest import batches, tiny_model


def _adversarial_f32() -> torch.Tensor:
    """Every end and every binade start, one fp32 ulp either side, both signs; fp32 subnormals, +-0,
    +-inf, NaN; and a wide random spread of magnitudes."""
    ends, _ = boundaries()
    pats = {p + d for p in (*ends, *(k << 23 for k in range(1, 256))) for d in (-1, 0, 1)}
    pats |= {0, 1, 2, 0x7FFFFF, 0x7F7FFFFF}                      # 0, the smallest subnormals, fp32 max
    bits = torch.tensor(sorted(p for p in pats if 0 <= p <= 0x7FC00000), dtype=torch.int32)
    mags = bits.view(torch.float32)
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-150, 129, (20_000,), generator=g).float())
    return torch.cat([mags, -mags, spread, torch.tensor([-0.0, math.inf, -math.inf, math.nan])])


def _all_16bit(dtype: torch.dtype) -> torch.Tensor:
    """Every one of the 65536 bit patterns of an fp16 or bf16 (subnormals, inf and NaN included)."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


ROUTES = ["native", "compiled", "eager"]


@contextlib.contextmanager
def _route(route: str):
    """Histograms count by ``route``: a CPU's own (native, the C counter), the compiled kernel that a GPU
    runs (here through Inductor's C++), or eager torch ops."""
    if route != "compiled":
        yield route != "eager"
        return
    real = range_histogram.count_values
    range_histogram.count_values = lambda x, scale, runs, fused: count_piece(x, scale, runs, fused)
    try:
        yield True
    finally:
        range_histogram.count_values = real


def _count(x, scale=None, route="native", pieces=1):
    with _route(route) as fused:
        h = RangeHistogram("cpu", fused=fused)
        for part in x.tensor_split(pieces):
            h.add(part, scale)
    return h.result()


def _stats(x, scale=None, route="native", pieces=1):
    """:func:`_count`, checking that the route asked for is the one that counted."""
    r = _count(x, scale, route, pieces)
    if route == "native":                                        # the C counter was built and counted
        assert range_native.native_counter() is not None
    if route == "compiled":                                      # the compiled kernel counted them
        assert fused_binning()[0].broken is None and fused_binning()[0]._compiled is not None
    return r


# --------------------------------------------------------------------------------- the bins
def test_table_and_compares_give_the_same_bin_for_every_chunk():
    # Both routes are constant on each 4096-pattern chunk except at an end of the form P + 1, so the
    # start, start + 1 and last pattern of all 2**19 chunks cover every case there is.
    chunks = torch.arange(1 << 19, dtype=torch.int32) << 12
    bits = torch.cat([chunks, chunks + 1, chunks + 4095])
    x = bits.view(torch.float32)
    _, eager = range_bins._eager_bins(x, None)
    compared = torch.empty_like(bits)
    range_bins.fused_binning()                                   # sets the ends the compares read
    range_bins._compare_bins(x, torch.tensor(1.0), compared)     # eagerly: no compiler involved
    assert torch.equal(eager, compared)
    # And each bin knows its exponent field and its bucket (ends at or below the pattern).
    _, exponent, bucket = bin_tables()
    ends = torch.tensor(boundaries()[0], dtype=torch.int64)
    assert torch.equal(exponent[compared.long()], (bits >> 23).long())
    assert torch.equal(bucket[compared.long()], torch.bucketize(bits.long(), ends, right=True))
    assert int(compared.max()) == N_BINS - 1                     # NaN: field 255, above all 14 ends


def test_the_cuda_histogram_counts_what_bincount_counts():
    # The index_add_ form CUDA uses (int32 indices, a broadcast 1), run here on the CPU.
    index = torch.tensor([0, 5, 5, 269, 3, 5, 0], dtype=torch.int32)
    assert torch.equal(range_bins._index_add_count(index, N_BINS), torch.bincount(index, minlength=N_BINS))
    assert range_bins._index_add_count(index, N_BINS)[5] == 3


def test_fp16_ends_worked_out_by_hand_are_bins_apart():
    # 2**-25 ties to fp16's zero, one ulp above rounds to its smallest subnormal: different bins.
    flush_end = format_thresholds(RANGE_FORMATS[0])[0]
    x = torch.tensor([flush_end - 1, flush_end], dtype=torch.int32).view(torch.float32)
    counts, _ = count_piece(x, None, (2,), fused=False)
    assert counts.count_nonzero() == 2


# ------------------------------------------------------------------------- fused against classify
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("scale", [None, 2.0**-16], ids=["unscaled", "scaled"])
def test_fp32_counts_equal_classify_at_every_edge(route, scale):
    x = _adversarial_f32()
    s = None if scale is None else torch.tensor(scale)
    r = _stats(x, s, route, pieces=3)
    xs = x if scale is None else x * scale                       # what classify must see: x in true units
    for fmt in RANGE_FORMATS:
        assert r.formats[fmt.name] == classify(xs, fmt), fmt.name
    finite = xs[torch.isfinite(xs)].abs()
    assert r.amax == finite.max().item() and r.count == x.numel()
    assert r.formats["fp16"].subnormal > 0 and r.formats["bf16"].flush > 0   # the edges were hit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scale", [None, 2.0**-24], ids=["unscaled", "scaled"])
def test_every_16_bit_pattern_is_counted_as_classify_counts_it(dtype, scale):
    # All 65536 values of the dtype; scaled by 2**-24 in fp32 (an fp16 gradient under a 2**24 loss
    # scale): fp16's subnormals land among fp32's normals, bf16's small values in fp32's subnormals.
    x = _all_16bit(dtype)
    s = None if scale is None else torch.tensor(scale)
    native, compiled, eager = (_stats(x, s, route) for route in ROUTES)
    assert native == compiled == eager
    xs = x.float() if scale is None else x.float() * scale
    for fmt in RANGE_FORMATS:
        assert native.formats[fmt.name] == classify(xs, fmt), fmt.name
    assert native.nonfinite == int((~torch.isfinite(xs)).sum()) and native.zeros == int((xs == 0).sum())
    # +-0; scaled bf16 adds its 254 subnormals and +-2**-126, whose products tie to fp32's zero or below.
    assert native.zeros == (258 if (dtype, scale) == (torch.bfloat16, 2.0**-24) else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_native_runs_equal_eager_runs_for_every_input_dtype(dtype):
    # Runs that end inside, at and just past the C counter's 256-value blocks and its 4-way unrolling,
    # in a strided view (made contiguous first); fp8 and float64 go to fp32 first, as on every route.
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6000, generator=g, dtype=torch.float64)
         * torch.exp2(torch.randint(-40, 40, (6000,), generator=g).double()))
    x[::97] = 0.0
    x[5::101] = math.inf
    x[7::103] = math.nan
    x = x.to(dtype)[::2]
    runs = (1, 3, 255, 256, 257, 1024, 1, 1203)
    assert sum(runs) == x.numel() and not x.is_contiguous()
    for scale in (None, torch.tensor(2.0**-20)):
        counts, amax = range_native.count_native(x, scale, runs)
        want_counts, want_amax = count_piece(x.contiguous(), scale, runs, fused=False)
        assert torch.equal(counts, want_counts) and torch.equal(amax, want_amax)
        assert counts.view(len(runs), N_BINS).sum(1).tolist() == list(runs)


def test_the_baseline_build_counts_what_the_vectorised_one_counts():
    # On x86-64 the loader runs the widest clone the CPU has (AVX-512 here): build the baseline alone,
    # as a libc without ifunc gets it, and count every edge and every 16-bit pattern with both.
    baseline, why_not = range_native._build(("-DMIXPREC_NO_CLONES",))
    assert baseline is not None, why_not
    for x in (_adversarial_f32(), _all_16bit(torch.float16), _all_16bit(torch.bfloat16)):
        for scale in (None, torch.tensor(2.0**-24)):
            runs = (x.numel() - 1000, 1000)
            got = range_native.count_native(x, scale, runs, baseline)
            want = range_native.count_native(x, scale, runs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_without_a_c_compiler_the_histogram_warns_once_and_counts_eagerly(monkeypatch):
    x = _adversarial_f32()
    expected = _stats(x, route="eager")
    for compiler, reason in [(lambda: None, "no C compiler found"), (lambda: "false", "false failed on range_count.c")]:
        range_native.native_counter.cache_clear()
        monkeypatch.setattr(range_native, "_compiler", compiler)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first, second = RangeHistogram("cpu"), RangeHistogram("cpu")
                first.add(x)
                second.add(x)
            notes = [w for w in caught if issubclass(w.category, FusionWarning)]
            assert len(notes) == 1 and reason in str(notes[0].message), [str(n.message) for n in notes]
            assert range_native.native_counter() is None
            assert first.result() == second.result() == expected
        finally:
            range_native.native_counter.cache_clear()      # later tests build it again
    monkeypatch.undo()
    assert range_native.native_counter() is not None


def _without_native(monkeypatch, reason: str, x: torch.Tensor) -> None:
    """The counter is not built, the one warning names ``reason``, and the eager route counts the same."""
    range_native.native_counter.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hist = RangeHistogram("cpu")
            hist.add(x)
        notes = [str(w.message) for w in caught if issubclass(w.category, FusionWarning)]
        assert len(notes) == 1 and reason in notes[0], notes
        assert hist.result() == _stats(x, route="eager")
    finally:
        monkeypatch.undo()
        range_native.native_counter.cache_clear()


def test_a_build_the_machine_cannot_do_warns_with_its_reason_and_counts_eagerly(monkeypatch, tmp_path):
    x = _adversarial_f32()[:20_000]
    # No writable temporary directory (the doctor used to exit with FileNotFoundError).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    _without_native(monkeypatch, "point TMPDIR at a writable directory", x)
    # A $CC that does not resolve is named, not silently replaced by cc.
    monkeypatch.setenv("CC", "no-such-compiler-mixprec")
    _without_native(monkeypatch, "$CC='no-such-compiler-mixprec' is not a program", x)
    # A compiler that hangs: stopped after the time limit, with the children it started.
    pid_file = tmp_path / "child.pid"
    cc = tmp_path / "hanging-cc"
    cc.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pid_file}\nwait\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(range_native, "_BUILD_SECONDS", 1)
    start = time.monotonic()
    _without_native(monkeypatch, "was still running after 1 s", x)
    assert time.monotonic() - start < 10               # one try, not one per set of flags
    stat = f"/proc/{int(pid_file.read_text())}/stat"
    for _ in range(50):                                  # SIGKILLed with its group: gone, or a zombie
        if not _running(stat):
            break
        time.sleep(0.05)
    assert not _running(stat)
    assert range_native.native_counter() is not None


def _running(stat: str) -> bool:
    try:
        with open(stat) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("route", ["native", "compiled"])
def test_segments_fused_equal_segments_eager_and_separate_adds(route):
    x = _adversarial_f32()
    sizes = [3, 0, 1, 5000, 10_000, x.numel() - 15_004]
    for scale, keep in [(None, None), (torch.tensor(2.0**-10), torch.tensor(True)), (None, torch.tensor(False))]:
        fused = [RangeHistogram("cpu") for _ in sizes]
        eager = [RangeHistogram("cpu", fused=False) for _ in sizes]
        with _route(route):
            RangeHistogram.add_segments(fused, x, sizes, scale, keep)
        RangeHistogram.add_segments(eager, x, sizes, scale, keep)
        for f, e, seg in zip(fused, eager, x.split(sizes)):
            alone = RangeHistogram("cpu", fused=False)
            alone.add(seg, scale, keep)
            assert f.result() == e.result() == alone.result()
    if route == "compiled":
        assert fused_binning()[1].broken is None and fused_binning()[1]._compiled is not None


def test_without_torch_compile_the_kernel_warns_once_and_counts_eagerly(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")
    x = _adversarial_f32()
    expected = _stats(x, route="eager")
    fused_binning.cache_clear()                        # fresh FusedFunctions that will try to compile
    monkeypatch.setattr(torch, "compile", no_compiler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = _count(x, route="compiled")        # fails to compile: runs the compares eagerly
            second = _count(x, None, "compiled", 2)    # broken: the eager table route from now on
        notes = [w for w in caught if issubclass(w.category, FusionWarning)]
        assert len(notes) == 1 and "no C++ compiler here" in str(notes[0].message)
        assert fused_binning()[0].broken == "RuntimeError: no C++ compiler here"
        assert first == second == expected
    finally:
        fused_binning.cache_clear()                    # later tests compile again


# ------------------------------------------------------------------------------ the batch
def test_batched_small_tensors_count_as_separate_adds():
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(50, generator=g) * 1e-6, torch.randn(7, generator=g).half(),
               torch.randn(3, generator=g).bfloat16(), torch.tensor([0.0, math.inf, math.nan, -2.0**-140]),
               torch.randn(1000, generator=g) * 1e5]
    scales = [None, torch.tensor(2.0**-16), None, torch.tensor(2.0**4), None]
    hists = [RangeHistogram("cpu") for _ in range(3)]
    owner = [0, 1, 0, 2, 1]                            # a histogram may appear more than once
    batch = SmallTensorBatch("cpu")
    alone = [RangeHistogram("cpu", fused=False) for _ in range(3)]
    for t, s, i in zip(tensors, scales, owner):
        batch.add(hists[i], t, s)
        alone[i].add(t, s)
    assert batch.pending == 5 and all(h.result().count == 0 for h in hists)
    batch.flush()
    assert batch.pending == 0
    assert [h.result() for h in hists] == [h.result() for h in alone]
    assert [h.tensors for h in hists] == [h.tensors for h in alone] == [2, 2, 1]


def test_batch_buffer_lives_where_the_tensors_are():
    # SmallTensorBatch("cuda") gets tensors on "cuda:0", which do not compare equal to "cuda": the
    # buffer is made on the first tensor's device. Here: a tensor on another device type goes around it.
    h, batch = RangeHistogram("cpu"), SmallTensorBatch("meta")
    batch.add(h, torch.tensor([1.0, 2.0]))              # cpu tensor, "meta" batch: counted at once
    assert batch.pending == 0 and h.result().count == 2
    cpu = SmallTensorBatch(torch.device("cpu"))
    cpu.add(h, torch.tensor([4.0]))
    assert cpu.pending == 1 and cpu._buffer.device == torch.device("cpu")


def test_batch_counts_values_as_they_were_when_added():
    h, batch = RangeHistogram("cpu"), SmallTensorBatch("cpu")
    x = torch.tensor([1.0, -2.0, 3.0])
    batch.add(h, x)
    x.zero_()                                          # an in-place op after the hook (ReLU(inplace=True))
    batch.flush()
    assert h.result().zeros == 0 and h.result().amax == 3.0


def test_a_full_batch_is_counted_and_reused(monkeypatch):
    monkeypatch.setattr(range_batch, "_CAPACITY", 100)
    h, batch = RangeHistogram("cpu"), SmallTensorBatch("cpu")
    big = torch.full((batch.max_values + 1,), 2.0)
    for i in range(5):
        batch.add(h, torch.full((40,), float(i + 1)))  # the 3rd and 5th do not fit: flush first
        assert batch.pending == [1, 2, 1, 2, 1][i]
    batch.add(h, big)                                  # too large to batch: counted at once
    assert h.result().count == 160 + big.numel()
    batch.flush()
    assert h.result().count == 200 + big.numel() and h.result().amax == 5.0


def _collect_two_fp16_steps(model, forward=None, fused=None):
    """What ``RangeCollector(mp, fused=fused)`` counts over two fp16 steps (loss scale 2**16 on the
    gradients) of ``model``, called through ``forward`` (the model itself by default)."""
    forward = forward or model
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
    collector = RangeCollector(mp, fused=fused)
    for x, y in batches(2):
        with collector.collecting():
            with mp.autocast():
                loss = F.cross_entropy(forward(x), y)
            mp.backward(loss)
            mp.step()
        mp.zero_grad()
    return collector.result()


def test_collector_routes_and_batch_give_the_same_counts():
    # Two identical runs, one counted eagerly, one fused.
    def run(fused):
        model = tiny_model()
        model[2] = nn.ReLU(inplace=True)               # rewrites the LayerNorm's output after its hook
        return _collect_two_fp16_steps(model, fused=fused)
    fused, eager = run(True), run(False)
    assert fused == eager
    norm = fused.module("1").stats["activations"]
    assert norm.count == 2 * 32 * 16 and norm.zeros == 0   # counted before the ReLU zeroed half of it
    assert fused.module("2").stats["activations"].zeros > 0


def test_the_c_counter_counts_a_compiled_model_as_an_eager_one():
    # Dynamo traces the collector's hooks with the model: the C counter must meet real tensors (a
    # graph break), never fake ones, and count what the same steps count uncompiled.
    eager_model, compiled_model = tiny_model(), tiny_model()
    eager = _collect_two_fp16_steps(eager_model)
    compiled = _collect_two_fp16_steps(compiled_model, torch.compile(compiled_model, backend="aot_eager"))
    assert compiled == eager and compiled.module("0").stats["activations"].count == 2 * 32 * 16


def test_fused_lost_update_masks_equal_update_lost():
    # Weights at fp16/bf16 edges (zero, subnormals, powers of two, max, past max, inf, NaN); updates of
    # every size around their half-gaps: w * 2**-k, both signs, and one fp32 ulp either side (ties).
    from mixprec.diagnostics import update_loss
    from mixprec.diagnostics.update_loss import UPDATE_FORMATS
    w = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, 2.0**-14, 2.0**-24, 3 * 2.0**-24, 2.0**-133, 1 / 3, 65504.0,
                      -65504.0, 65520.0, 1e30, 3.38e38, math.inf, math.nan])
    k = torch.arange(0, 31, dtype=torch.float32)
    base = (w.abs().clamp(min=2.0**-30).nan_to_num(posinf=1.0)[:, None] * torch.exp2(-k)[None, :]).flatten()
    near = torch.cat([base, torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(math.inf))])
    u = torch.cat([near, -near, torch.tensor([0.0, -0.0, math.inf, math.nan, 1e-45])])
    ww = w.repeat(u.numel() // w.numel() + 1)[:u.numel()]
    for shift in range(w.numel()):                     # every weight meets every update
        wi = ww.roll(shift)
        fused = update_loss.lost_masks(wi, u)
        for fmt, mask in zip(UPDATE_FORMATS, fused):
            assert torch.equal(mask, update_lost(wi, u, fmt)), (fmt.name, shift)
    assert update_loss._fused_lost.broken is None and update_loss._fused_lost._compiled is not None

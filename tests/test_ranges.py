"""Range statistics: exact counters against classify, update underflow by hand, the scale window, true units."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.diagnostics.range_histogram import RANGE_FORMATS, RangeHistogram, TensorStats, format_thresholds
from mixprec.diagnostics.range_collector import RangeCollector, select_modules, update_lost
from mixprec.diagnostics.scale_window import below_floor, scale_window
from mixprec.formats import FP16, TF32, classify, quantize

from conftest import batches, tiny_model


def _stats(values, dtype=torch.float32) -> TensorStats:
    h = RangeHistogram("cpu")
    h.add(torch.tensor(values, dtype=torch.float64).to(dtype))
    return h.result()


def _f32(bits: int) -> float:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()


# ------------------------------------------------------------------------------- the histogram
def test_histogram_counts_of_a_known_tensor():
    s = _stats([0.0, 1.0, 1.5, 2.0, -3.0, 0.25, -0.0, 2.0**-130, math.inf, math.nan])
    assert (s.count, s.zeros, s.nonfinite) == (10, 2, 2)
    assert s.amax == 3.0                                  # the largest *finite* magnitude
    # floor(log2|x|): 1, 1.5 -> 0; 2, -3 -> 1; 0.25 -> -2; fp32 subnormals are lumped into -127.
    assert s.exponent_counts() == {0: 2, 1: 2, -2: 1, -127: 1}


def test_fp16_thresholds_worked_out_by_hand():
    flush_end, normal_start, overflow_start = (_f32(b) for b in format_thresholds(FP16))
    assert flush_end == np.nextafter(np.float32(2.0**-25), np.float32(1))  # 2**-25 itself ties to 0
    assert normal_start == 2.0**-14 - 2.0**-25                            # the tie goes to min_normal
    assert overflow_start == 65520.0                                      # the tie above max goes to inf


@pytest.mark.parametrize("fmt", RANGE_FORMATS, ids=lambda f: f.name)
def test_format_counts_equal_classify_at_every_boundary(fmt):
    # Each threshold, one fp32 ulp either side, plus a wide random spread of magnitudes and signs.
    edges = torch.tensor([b + d for b in format_thresholds(fmt) for d in (-1, 0, 1)], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-150, 129, (20_000,), generator=g)
                                                            .float())
    x = torch.cat([edges.view(torch.float32), -edges.view(torch.float32), spread,
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])])
    h = RangeHistogram("cpu")
    h.add(x[:7000])
    h.add(x[7000:])                                       # accumulates across calls
    counts = h.result().formats[fmt.name]
    assert counts == classify(x, fmt)
    assert counts.flush > 0 and counts.subnormal > 0 and counts.overflow > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_input_is_counted_exactly(dtype):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)).mul(1e-4).to(dtype)
    s = RangeHistogram("cpu")
    s.add(x)
    r = s.result()
    for fmt in RANGE_FORMATS:
        assert r.formats[fmt.name] == classify(x.float(), fmt)
    assert r.amax == x.float().abs().max().item()


def test_scale_and_keep():
    x = torch.tensor([3.0 * 2**20, 2.0**30, -5.0])
    a, b, c = RangeHistogram("cpu"), RangeHistogram("cpu"), RangeHistogram("cpu")
    a.add(x, scale=torch.tensor(2.0**-16))
    b.add(x * 2.0**-16)
    assert a.result() == b.result()
    assert a.result().exponent_counts() == {5: 1, 14: 1, -14: 1}
    c.add(x, keep=torch.tensor(False))                    # decided on the device: nothing counted
    assert c.result().count == 0 and c.result().amax == 0.0
    c.add(x, keep=torch.tensor(True))
    assert c.result().count == 3


def test_scale_applies_in_fp32_to_low_precision_input():
    # fp16 gradients under a 2**16 loss scale: multiplied in fp16, 2**-10 * 2**-16 would flush to zero.
    x = torch.tensor([2.0**-10, 3 * 2.0**-12, 1.0, -(2.0**-14)], dtype=torch.float16)
    a, b = RangeHistogram("cpu"), RangeHistogram("cpu")
    a.add(x, scale=torch.tensor(2.0**-16))
    b.add(x.float() * 2.0**-16)
    assert a.result() == b.result() and a.result().zeros == 0


@pytest.mark.parametrize("piece", [1000, 1 << 19])
def test_segments_count_as_separate_adds(monkeypatch, piece):
    # Pieces of 1000 values make segments start, end and span pieces (and the empty one in between).
    import mixprec.diagnostics.range_histogram as range_stats
    monkeypatch.setattr(range_stats, "_PIECE", piece)
    fmt = RANGE_FORMATS[0]
    edges = torch.tensor([b + d for b in format_thresholds(fmt) for d in (-1, 0, 1)], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    sizes = [5, 0, 1, 999, 2500, 3, 4000]
    flat = torch.randn(sum(sizes), generator=g) * torch.exp2(torch.randint(-40, 20, (sum(sizes),), generator=g).float())
    flat[:9] = edges.view(torch.float32)
    flat[1000:1003] = torch.tensor([math.inf, math.nan, -0.0])
    for scale, keep in [(None, None), (torch.tensor(2.0**-10), torch.tensor(True)), (None, torch.tensor(False))]:
        together = [RangeHistogram("cpu") for _ in sizes]
        RangeHistogram.add_segments(together, flat, sizes, scale, keep)
        for h, seg in zip(together, flat.split(sizes)):
            alone = RangeHistogram("cpu")
            alone.add(seg, scale, keep)
            assert h.result() == alone.result()
    with pytest.raises(ValueError, match="one size per histogram"):
        RangeHistogram.add_segments(together, flat, sizes[:-1])


# --------------------------------------------------------------------------- update underflow
def test_update_lost_on_fp16_worked_out_by_hand():
    # w = 1.0 in fp16: ulp above is 2**-10, below (the binade under a power of two) 2**-11.
    u = torch.tensor([2**-12, 2**-11, 2**-11 + 2**-30, 3 * 2**-12, -(2**-12), -(2**-12 + 2**-20), 0.0,
                      math.nan])
    lost = update_lost(torch.ones(len(u)), u, "fp16")
    # 2**-11 ties to the even 1.0; 2**-11 + 2**-30 does not, though its fp32 sum 1 + 2**-11 (rounded)
    # would tie: a naive quantize(w + u) == w says lost here. Zero and NaN updates are never "lost".
    assert lost.tolist() == [True, True, False, False, True, False, False, False]
    # 1 + 2**-10 has an odd significand: the same tie rounds away from it, to 1 + 2**-9.
    assert update_lost(torch.tensor([1 + 2**-10]), torch.tensor([2.0**-11]), "fp16").tolist() == [False]
    # At zero the gap is the smallest subnormal 2**-24: half of it ties back to the even zero.
    assert update_lost(torch.zeros(2), torch.tensor([2.0**-25, 1.5 * 2**-25]), "fp16").tolist() == [True, False]


def test_update_lost_on_bf16_worked_out_by_hand():
    # bf16 keeps 7 mantissa bits: ulp(1) = 2**-7, so |u| <= 2**-8 vanishes (the tie to even included).
    u = torch.tensor([2**-9, 2**-8, 3 * 2**-9, 2**-5])
    assert update_lost(torch.ones(4), u, "bf16").tolist() == [True, True, False, False]
    # The paper's rule for fp16, lost once |w| / |u| > 2048, is exact at a power of two (elsewhere in
    # the binade the ratio needed is up to 4096): at w = 2 half an ulp is 2**-10 = 2 / 2048.
    w = torch.full((2,), 2.0)
    assert update_lost(w, torch.tensor([2.0 / 2049, 2.0 / 2047]), "fp16").tolist() == [True, False]
    assert update_lost(torch.tensor([3.9, 3.9]), torch.tensor([3.9 / 4001, 3.9 / 3000]), "fp16").tolist() == [True, False]


def test_update_lost_agrees_with_numpy_fp16_rounding():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(20_000, generator=g) * 4).to(torch.float16).float()   # already fp16 values
    u = torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-16, -6, (20_000,), generator=g).float())
    u = u * w.abs()                                                        # near the half-ulp boundary
    u[:500] = w[:500].abs() * 2.0**-11                                     # exact ties
    # float64 holds w + u exactly here (their exponents are < 30 apart); numpy rounds it once to fp16.
    w16, u64 = w.numpy().astype(np.float16), u.numpy().astype(np.float64)
    reference = (w16.astype(np.float64) + u64).astype(np.float16) == w16
    reference &= u64 != 0
    assert torch.equal(update_lost(w, u, "fp16"), torch.from_numpy(reference))


def _update_lost_by_ulp(w, u, fmt):
    """A second derivation of update_lost: quantize, the ulp from the fp32 exponent, the denser binade
    below a power of two as a special case, parity from the integer significand."""
    w_q = quantize(w, fmt)
    bits = w_q.view(torch.int32) & 0x7FFFFFFF
    binade = ((bits >> 23) - 127).clamp(min=fmt.min_exponent)
    ulp = torch.exp2((binade - fmt.mantissa_bits).double())
    toward_zero = (bits != 0) & ((u > 0) != (w_q > 0))
    denser_below = toward_zero & ((bits & 0x7FFFFF) == 0) & (binade > fmt.min_exponent)
    half_gap = torch.where(denser_below, ulp / 4, ulp / 2)
    even = torch.remainder(w_q.abs().double() / ulp, 2) == 0
    size = u.abs().double()
    vanishes = (size < half_gap) | ((size == half_gap) & even)
    return vanishes & (u != 0) & torch.isfinite(u) & torch.isfinite(w_q)


@pytest.mark.parametrize("fmt", [*RANGE_FORMATS, TF32], ids=lambda f: f.name)
def test_update_lost_equals_the_ulp_derivation_at_every_edge(fmt):
    # Weights at fmt's edges (zero, subnormals, min_normal, powers of two, max, inf, NaN, both signs,
    # values that round) against updates of every power of two and one fp32 ulp either side: each
    # half gap, quarter gap (below a power of two) and tie is hit exactly and missed by one ulp.
    sub, norm = fmt.min_subnormal, fmt.min_normal
    w = torch.tensor([0.0, sub, 2 * sub, 3 * sub, norm - sub, norm, norm * (1 + fmt.eps), 2 * norm,
                      0.5, 1.0, 1.0 + fmt.eps, 1.5, 3.0, fmt.max / 2, fmt.max * (1 - fmt.eps / 2), fmt.max,
                      1.0 + fmt.eps / 3, 0.1, math.inf, math.nan], dtype=torch.float64)
    w = torch.cat([w, -w]).float()
    powers = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    near = torch.cat([powers, torch.nextafter(powers, torch.tensor(0.0)), torch.nextafter(powers, torch.tensor(math.inf))])
    u = torch.cat([near, -near, torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])])
    W, U = torch.broadcast_tensors(w[:, None], u[None, :])
    W, U = W.reshape(-1), U.reshape(-1)
    lost = update_lost(W, U, fmt)
    assert torch.equal(lost, _update_lost_by_ulp(W, U, fmt))
    assert 0 < lost.sum() < lost.numel()


# ------------------------------------------------------------------------------- scale window
def test_scale_window_on_crafted_gradients():
    # 99 gradients of 2**-20 and one of 2**-40: the 1% allowed below 2**-24 is the tiny one, so the
    # window starts where 2**-20 reaches the floor, 2**-4; the top is floor(log2(65504 / (8 * 2**-20))).
    w = scale_window(_stats([2.0**-20] * 99 + [2.0**-40]))
    assert (w.low, w.high, w.recommended) == (-4, 32, 32)
    assert w.below_floor_unscaled == pytest.approx(0.01)
    # Two tiny ones (2%): now 2**-40 must be lifted to 2**-24.
    assert scale_window(_stats([2.0**-20] * 98 + [2.0**-40] * 2)).low == 16
    # Tiny and huge together: 2**16 is needed, the largest (2**10) allows only 2**2: no window.
    none = scale_window(_stats([2.0**-40, 2.0**10]))
    assert (none.low, none.high, none.recommended, none.fits) == (16, 2, None, False)
    assert below_floor(_stats([2.0**-30, 2.0**-10]), 6) == 0.0      # 2**-30 * 2**6 == 2**-24 exactly
    assert below_floor(_stats([2.0**-30, 2.0**-10]), 5) == 0.5
    assert scale_window(_stats([0.0, 0.0])).low is None


# ------------------------------------------------------------------------------- the collector
def _train(recipe, steps=2, collector_modules=None, enabled=True):
    model = tiny_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    collector = RangeCollector(mp, collector_modules)
    for x, y in batches(steps):
        with collector.collecting(enabled=enabled):
            with mp.autocast():
                loss = F.cross_entropy(model(x), y)
            mp.backward(loss)
            mp.step()
        mp.zero_grad()
    return collector.result(), mp


def test_gradients_are_reported_in_true_units_under_a_loss_scale():
    # fp32 compute: multiplying by 1024 and dividing again is exact, so every count must match a run
    # without a loss scale bit for bit, gradients included.
    plain, _ = _train("fp32")
    scaled, mp = _train("params=fp32,compute=fp32,scale=static:1024")
    assert mp.scale == 1024
    assert plain == scaled
    assert plain.module("3").stats["weight_grads"].count == 2 * (4 * 16 + 4)   # 2 steps of W and b


def test_fp16_gradients_match_fp32_in_true_units():
    fp32, _ = _train("fp32", steps=1)
    fp16, mp = _train("fp16", steps=1)                   # dynamic scale 2**16: gradients carry it
    assert mp.scale == 2.0**16
    for name in ("0", "3"):
        a, b = fp32.module(name).stats["weight_grads"], fp16.module(name).stats["weight_grads"]
        assert b.amax == pytest.approx(a.amax, rel=2e-3)  # fp16 rounding, not a factor of 65536


def test_collector_installs_nothing_when_off_or_closed():
    model = tiny_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
    collector = RangeCollector(mp)
    with collector.collecting(enabled=False):
        assert not any(m._forward_hooks for m in model.modules()) and not mp._step_observers
    with collector.collecting():
        assert all(m._forward_hooks for m in model.modules() if m is not model) and mp._step_observers
    assert not any(m._forward_hooks for m in model.modules()) and not mp._step_observers
    assert collector.steps == 1


def test_skipped_steps_count_no_updates():
    model = tiny_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
    collector = RangeCollector(mp)
    for i, (x, y) in enumerate(batches(3)):
        with collector.collecting():
            with mp.autocast():
                loss = F.cross_entropy(model(x), y) * (math.inf if i == 1 else 1.0)
            mp.backward(loss)
            mp.step()
        mp.zero_grad()
    assert mp.skipped_steps == 1
    r = collector.result().module("0")
    n = 8 * 16 + 16
    assert r.update_loss.updates == 2 * n               # the skipped step is left out
    assert r.stats["updates"].count == 2 * n
    assert r.stats["weight_grads"].count == 3 * n and r.stats["weight_grads"].nonfinite > 0


def test_unknown_module_names_suggest_close_matches():
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(4, 4))
    model.add_module("decoder", nn.Linear(4, 4))
    with pytest.raises(ValueError, match="did you mean 'encoder'"):
        select_modules(model, ["encodr"])
    assert list(select_modules(model, ["decoder"])) == ["decoder"]
    assert list(select_modules(model)) == ["encoder", "decoder"]
    assert list(select_modules(nn.Linear(2, 2))) == [""]  # a bare layer is its own module


def test_module_names_given_as_one_string_are_refused():
    # Iterated, "decoder" was the names "d", "e", ... (and "0" happened to work): a list is what it takes.
    model = nn.Sequential()
    model.add_module("decoder", nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"modules takes a list of module names, e.g. \['decoder'\], not a string"):
        select_modules(model, "decoder")


def test_tied_weights_are_counted_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight                      # tied, as GPT's head and embedding
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
    collector = RangeCollector(mp)
    with collector.collecting():
        mp.backward(F.cross_entropy(model(torch.arange(6)), torch.arange(6)))
        mp.step()
    r = collector.result()
    assert r.module("0").stats["weights"].count == 40 and "weights" not in r.module("1").stats


@pytest.mark.parametrize("group", [1 << 19, 20])
def test_lost_updates_per_module_equal_update_lost(monkeypatch, group):
    # Groups of 20 values split the model's modules into several passes (and its biases into their own).
    import mixprec.diagnostics.range_collector as ranges
    monkeypatch.setattr(ranges, "_LOST_GROUP", group)
    model = tiny_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=3e-4), "fp32")
    collector = RangeCollector(mp)
    before = {n: [p.detach().clone() for p in model.get_submodule(n).parameters()] for n in ("0", "1", "3")}
    x, y = batches(1)[0]
    with collector.collecting():
        mp.backward(F.cross_entropy(model(x), y))
        mp.step()
    r = collector.result()
    for name, ws in before.items():
        params = list(model.get_submodule(name).parameters())
        for fmt in ("fp16", "bf16"):
            expected = sum(int(update_lost(w, p.detach() - w, fmt).sum()) for w, p in zip(ws, params))
            assert r.module(name).update_loss.lost[fmt] == expected
        assert r.module(name).update_loss.updates == sum(p.numel() for p in params)
    lost = r.module("0").update_loss.lost
    assert 0 < lost["fp16"] < lost["bf16"]            # bf16 keeps 3 fewer bits: loses more


def test_every_k_th_step_is_sampled():
    model = tiny_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
    collector = RangeCollector(mp, every=3)
    installed = []
    for x, y in batches(7):
        with collector.collecting():
            installed.append(bool(mp._step_observers))
            mp.backward(F.cross_entropy(model(x), y))
            mp.step()
        mp.zero_grad()
    assert installed == [True, False, False, True, False, False, True]
    r = collector.result()
    assert r.steps == 3 and r.module("0").stats["weights"].count == 3 * (8 * 16 + 16)
    with pytest.raises(ValueError, match="every must be a positive int"):
        RangeCollector(mp, every=0)

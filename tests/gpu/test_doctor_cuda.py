"""CUDA-only checks for the doctor's counters: no host sync while collecting, same counts as on the CPU."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.diagnostics.range_histogram import RangeHistogram
from mixprec.diagnostics.range_collector import RangeCollector, update_lost

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def test_sync_guard_catches_a_real_sync(no_sync):
    # The harness itself: a value read back to the host inside the region is an error.
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), no_sync():
        x.sum().item()


def test_histogram_on_cuda_counts_what_the_cpu_counts_without_a_sync(no_sync):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-140, 120, (100_000,), generator=g).float())
    cpu, gpu = RangeHistogram("cpu"), RangeHistogram("cuda")
    cpu.add(x)
    # Made before the guarded region: torch.tensor(value, device="cuda") is a host-to-device copy.
    x_cuda, scale, keep = x.cuda(), torch.tensor(1.0, device="cuda"), torch.tensor(True, device="cuda")
    gpu.add(x_cuda[:10])                     # first call: lazy CUDA setup may sync
    with no_sync():
        gpu.add(x_cuda[10:], scale=scale, keep=keep)
    assert gpu.result() == cpu.result()


def test_segments_on_cuda_count_what_the_cpu_counts_without_a_sync(no_sync):
    g = torch.Generator().manual_seed(2)
    sizes = [64, 1, 700_000, 5000]        # the big one spans two pieces of 2**19
    flat = torch.randn(sum(sizes), generator=g) * torch.exp2(torch.randint(-140, 120, (sum(sizes),), generator=g).float())
    cpu = [RangeHistogram("cpu") for _ in sizes]
    RangeHistogram.add_segments(cpu, flat, sizes)
    gpu = [RangeHistogram("cuda") for _ in sizes]
    flat_cuda, scale, keep = flat.cuda(), torch.tensor(1.0, device="cuda"), torch.tensor(True, device="cuda")
    RangeHistogram.add_segments([RangeHistogram("cuda") for _ in sizes], flat_cuda, sizes)   # warm-up
    with no_sync():
        RangeHistogram.add_segments(gpu, flat_cuda, sizes, scale=scale, keep=keep)
    assert [h.result() for h in gpu] == [h.result() for h in cpu]


def test_update_lost_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50_000, generator=g)
    u = torch.randn(50_000, generator=g) * 1e-4
    for fmt in ("fp16", "bf16"):
        assert torch.equal(update_lost(w.cuda(), u.cuda(), fmt).cpu(), update_lost(w, u, fmt))


@pytest.mark.parametrize("recipe", ["fp16", "bf16", "fp16-pure"])
def test_collecting_a_step_does_not_sync(recipe, no_sync):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).cuda()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe)
    collector = RangeCollector(mp)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    for step in range(3):
        with no_sync() if step == 2 else contextlib.nullcontext():    # steps 0 and 1 warm up
            with collector.collecting():
                with mp.autocast():
                    loss = F.cross_entropy(model(x), y)
                mp.backward(loss)
                mp.step()
            mp.zero_grad()
    r = collector.result()
    assert r.steps == 3 and r.module("0").stats["weights"].count == 3 * (64 * 128 + 128)


def _edges_and_16bit():
    """fp32 values at every bucket end and binade start (+-1 ulp, both signs), and every fp16 and bf16
    pattern: the values where a CUDA kernel that rounded, flushed subnormals or mis-compared would show."""
    from mixprec.diagnostics.range_bins import boundaries
    pats = {p + d for p in (*boundaries()[0], *(k << 23 for k in range(1, 256))) for d in (-1, 0, 1)}
    mags = torch.tensor(sorted(p for p in pats | {0, 1, 2} if 0 <= p <= 0x7FC00000), dtype=torch.int32)
    f32 = torch.cat([mags.view(torch.float32), -mags.view(torch.float32)])
    all16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    return f32, all16.view(torch.float16), all16.view(torch.bfloat16)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-triton", "eager"])
def test_both_routes_on_cuda_count_every_edge_as_the_cpu_does_without_a_sync(fused, no_sync):
    from mixprec.diagnostics.range_bins import fused_binning
    scale = torch.ones((), device="cuda") * 2.0**-24         # a fill and a multiply: no host copy
    for x in _edges_and_16bit():
        for s in (None, scale):
            cpu, gpu = RangeHistogram("cpu", fused=False), RangeHistogram("cuda", fused=fused)
            cpu.add(x, None if s is None else torch.tensor(2.0**-24))
            x_cuda = x.cuda()
            RangeHistogram("cuda", fused=fused).add(x_cuda, s)      # warm-up: compiles, lazy setup
            with no_sync():
                gpu.add(x_cuda, s)
            assert gpu.result() == cpu.result(), (x.dtype, s is not None)
    if fused:     # the Triton kernels really ran (a broken compile would fall back and still pass)
        assert all(f.broken is None and f._compiled is not None for f in fused_binning()[:1])


def test_fused_lost_update_masks_on_cuda_equal_the_cpu():
    from mixprec.diagnostics import update_loss
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-30, 17, (200_000,), generator=g).float())
    u = w * torch.exp2(-torch.randint(5, 14, (200_000,), generator=g).float())
    u = torch.where(torch.arange(200_000) % 3 == 0, torch.nextafter(u, torch.zeros(())), u)   # ties +- 1 ulp
    cuda = update_loss.lost_masks(w.cuda(), u.cuda())
    for fmt, mask in zip(update_loss.UPDATE_FORMATS, cuda):
        assert torch.equal(mask.cpu(), update_lost(w, u, fmt)), fmt.name
    assert update_loss._fused_lost.broken is None

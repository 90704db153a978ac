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

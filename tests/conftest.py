"""Shared fixtures: tiny models that exercise every part of a recipe (a norm kept fp32, two linears)."""

import contextlib
import copy

import pytest
import torch
from torch import nn


def tiny_model(seed: int = 0, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, d_out))


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-momentum-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam-forloop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
}


def batches(n: int, seed: int = 1, batch: int = 32, d_in: int = 8, d_out: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g))
            for _ in range(n)]


def master_state(mp) -> tuple:
    """What a pure-recipe step may change: the model's weights, the fp32 master copies, the optimizer state."""
    return ([t.detach().clone() for t in mp.model.state_dict().values()],
            [m.detach().clone() for m in mp.master.masters],
            copy.deepcopy(mp.optimizer.state_dict()["state"]))


def assert_same_state(a: tuple, b: tuple) -> None:
    """Two ``master_state`` snapshots equal bit for bit (the same optimizer-state entries, too)."""
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    assert a[2].keys() == b[2].keys()
    for i in a[2]:
        for k in a[2][i]:
            assert torch.equal(torch.as_tensor(a[2][i][k]), torch.as_tensor(b[2][i][k])), (i, k)


def same_nested(a, b) -> bool:
    """Nested state (dicts, lists, tuples of tensors and plain values) equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def model():
    return tiny_model()


# ----------------------------------------------------------------------- CUDA tests (tests/gpu)
@contextlib.contextmanager
def _sync_is_an_error():
    torch.cuda.synchronize()             # work queued before the region may not count against it
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def fp8_gpu() -> None:
    """Skip the calling test, with the reason, where the GPU has no fp8 matmuls (compute capability < 8.9)."""
    from mixprec.fp8 import probe_scaled_mm
    support = probe_scaled_mm("cuda")
    if not support.ok:
        pytest.skip(f"no fp8 matmuls on this GPU: {support.reason}")


@pytest.fixture
def no_sync():
    """``with no_sync(): ...`` raises RuntimeError at the first call that makes the host wait for the GPU.

    Make every CUDA tensor the region needs *before* entering it: ``torch.tensor(1.0, device="cuda")``
    copies a host value to the device, and that copy is itself a sync (the H100 run of 2026-11-22
    failed two doctor tests on exactly that, not on the code under test). ``torch.ones((), device=
    "cuda")`` is a fill kernel and is fine. Warm up first: lazy CUDA setup may sync once.
    """
    return _sync_is_an_error

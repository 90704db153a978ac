"""Shared harness of the CUDA tests: a region in which any host-device synchronisation is an error."""

import contextlib

import pytest
import torch


@contextlib.contextmanager
def _sync_is_an_error():
    torch.cuda.synchronize()             # work queued before the region may not count against it
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture
def no_sync():
    """``with no_sync(): ...`` raises RuntimeError at the first call that makes the host wait for the GPU.

    Make every CUDA tensor the region needs *before* entering it: ``torch.tensor(1.0, device="cuda")``
    copies a host value to the device, and that copy is itself a sync (the H100 run of 2026-11-22
    failed two doctor tests on exactly that, not on the code under test). ``torch.ones((), device=
    "cuda")`` is a fill kernel and is fine. Warm up first: lazy CUDA setup may sync once.
    """
    return _sync_is_an_error

"""Start N processes in one torch.distributed group on this machine, with a deadline.

What ``torchrun --nproc-per-node N`` does for a script, for a function: a free TCP port on localhost,
one process per rank (the ``spawn`` start method, so CUDA is safe), ``init_process_group`` before the
function runs and ``destroy_process_group`` after. A rank that raises fails the whole run with its
traceback; a run past ``timeout_s`` is terminated and raises ``TimeoutError`` instead of hanging (a
rank stuck in a collective whose peer died would otherwise wait forever)::

    run_processes(worker, 2, (out_dir,), backend="gloo", timeout_s=120)
    # each rank calls worker(rank, world_size, out_dir)

Backends: ``gloo`` (CPU tensors) or ``nccl`` (one CUDA GPU per rank: rank r uses cuda:r).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

__all__ = ["run_processes", "free_port", "default_backend"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device_type: str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, args: tuple) -> None:
    # A rank killed by a signal from C++ (SIGABRT, SIGSEGV: a collective library's thread) would only
    # show "terminated with signal" in the parent; this prints where its Python threads were first.
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # No rank tears its connections down while a peer may still be using them.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_processes(fn: Callable[..., Any], nproc: int, args: tuple = (), *, backend: str = "gloo",
                  timeout_s: float | None = None, on_tick: Callable[[], None] | None = None) -> None:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` fresh processes of one group; wait for all of them.

    ``fn`` must be importable by name (a module-level function). Raises ``ValueError`` for a bad
    ``nproc`` or backend, ``TimeoutError`` past the deadline (all ranks are terminated first), and
    torch's ``ProcessRaisedException`` (with the rank's traceback) if a rank fails. ``on_tick()`` is
    called about once a second while the ranks run (to show their progress). Ctrl-C (or any error
    here) terminates the ranks at once instead of leaving the interpreter waiting for them.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; valid values: gloo (CPU), nccl (CUDA)")
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        raise ValueError(f"nccl needs one GPU per process: {nproc} processes asked for, "
                         f"{torch.cuda.device_count()} GPU(s) visible; use fewer or --device cpu")
    context = torch_mp.start_processes(_entry, args=(fn, nproc, free_port(), backend, args),
                                       nprocs=nproc, join=False, start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if on_tick is not None:
                on_tick()
            if deadline is not None and time.monotonic() > deadline:
                _stop(context)
                raise TimeoutError(f"{nproc} processes did not finish within {timeout_s:g} s; terminated "
                                   "(a rank stuck in a collective whose peer failed or never arrived?)")
    except BaseException:
        _stop(context)       # Ctrl-C, a rank's failure, the deadline: no rank outlives the call
        raise
    if on_tick is not None:
        on_tick()            # what the ranks reported last


def _stop(context: Any) -> None:
    """Terminate every live rank, give each 5 s, then kill what is left."""
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(5)
        if process.is_alive():
            process.kill()

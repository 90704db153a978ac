"""The CPU's range counter: ``range_count.c``, built with the system's C compiler on first use.

On a CPU the counting is most of the doctor's cost, and torch has no one-pass histogram: its
``bincount`` is a serial loop that scans its input for the min and the max first, and the bin of
each value must be written by one kernel and read back by the next. ``range_count.c`` bins as
:mod:`.range_bins` does (the exponent field plus one compare per end, vectorised) and counts in the
same pass over each block of 256 values, which stay in the L1 cache between the two: 0.9-1.1 ns per
value on one core in isolation and 1.07 ns inside the doctor's gpt step, against 2.0 ns there for
the compiled kernel plus ``bincount`` and 3.0 ns for eager ops (benchmarks/HISTORY.md). On x86-64
gcc builds it for AVX-512, AVX2 and the baseline at once and the loader picks what the CPU has (where
the C library cannot pick, as musl's, it is built once more for the baseline alone).

Why not a C++ extension of torch: building against torch's headers takes most of a minute, and
Inductor's C++ build of the compiled kernel takes seconds. This file includes only ``<stdint.h>``
and ``<string.h>`` and builds in under half a second, so it is built once per process in a
temporary directory that is removed once the library is loaded: nothing cached on disk to go stale
or to share between machines. The compiler is ``$CC`` when set (a ``$CC`` that does not resolve is a
reason not to build, never silently swapped for another), else ``cc``, ``gcc`` or ``clang``. Where
none is found, the temporary directory cannot be made or written (no writable ``$TMPDIR``, a full
disk), or the build fails or outlives ``_BUILD_SECONDS`` (the compiler and its children are killed),
:func:`native_counter` warns once (:class:`~mixprec.fusion.FusionWarning`, with the reason) and
returns ``None``, and the histogram counts by the eager route: the same numbers, in about three
times the time.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import warnings
from importlib import resources

import torch

from ..fusion import FusionWarning
from .range_bins import N_BINS, boundaries

__all__ = ["count_native", "native_counter"]

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # the C file's enum
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99")                  # never -ffast-math: subnormals count
_BUILD_SECONDS = 20     # a build takes under half a second; a compiler still running at 20 s is stuck


def _compiler() -> str | None:
    """``$CC`` if set (resolved or not: ``_build`` says when it does not), else the first found."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    return next((name for name in ("cc", "gcc", "clang") if shutil.which(name)), None)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler in its own process group, so a timeout kills it and everything it started."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=_BUILD_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@functools.cache
def native_counter() -> ctypes._CFuncPtr | None:
    """``mixprec_count_runs`` from a fresh build of ``range_count.c``; ``None``, said once, where it fails."""
    try:
        fn, why_not = _build()
        if fn is None:      # e.g. a libc without ifunc, which the x86 clones need: one plain build more
            fn, _ = _build(("-DMIXPREC_NO_CLONES",))
    except _CannotBuild as exc:     # nothing to gain from a second try: no compiler, no disk, a hang
        fn, why_not = None, str(exc)
    if fn is None:
        warnings.warn(f"mixprec could not build its range counter here ({why_not}); the doctor counts with "
                      "eager torch ops instead (the same numbers, counted about 3x slower). Set CC to a "
                      "working C compiler to get it.", FusionWarning, stacklevel=3)
    return fn


class _CannotBuild(Exception):
    """This machine cannot build the counter at all (as opposed to one set of flags failing)."""


def _build(extra: tuple[str, ...] = ()) -> tuple[ctypes._CFuncPtr | None, str]:
    """The loaded function built with the ``extra`` compiler flags, or ``None`` and why not.

    Raises ``_CannotBuild`` where no build can succeed, whatever the flags.
    """
    cc = _compiler()
    if cc is None:
        raise _CannotBuild("no C compiler found: $CC, cc, gcc or clang")
    if shutil.which(cc) is None:
        raise _CannotBuild(f"$CC={cc!r} is not a program on PATH (unset CC, or point it at a C compiler)")
    ends = boundaries()[0]
    source = resources.files(__package__).joinpath("range_count.c").read_text()
    defines = (f"-DMIXPREC_N_ENDS={len(ends)}", f"-DMIXPREC_ENDS={','.join(f'{e:#x}u' for e in ends)}")
    try:
        with tempfile.TemporaryDirectory(prefix="mixprec-native-") as tmp:
            src, lib = os.path.join(tmp, "range_count.c"), os.path.join(tmp, "range_count.so")
            with open(src, "w") as f:
                f.write(source)
            try:
                done = _run([cc, *_FLAGS, *defines, *extra, "-o", lib, src])
            except subprocess.TimeoutExpired:
                raise _CannotBuild(f"{cc} was still running after {_BUILD_SECONDS} s (stopped)") from None
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["no message"])[0][:200]
                return None, f"{cc} failed on range_count.c: {first}"
            try:
                fn = ctypes.CDLL(lib).mixprec_count_runs      # stays mapped after the file is removed
            except (OSError, AttributeError) as exc:
                return None, f"the built library did not load: {exc}"
    except OSError as exc:    # no writable temp dir, a full disk, a compiler that cannot start
        where = os.environ.get("TMPDIR") or "the system's temporary directory"
        raise _CannotBuild(f"could not build in {where} ({exc}); point TMPDIR at a writable directory") from None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p]
    return fn, ""


def count_native(x: torch.Tensor, scale: torch.Tensor | None, runs: tuple[int, ...],
                 fn: ctypes._CFuncPtr | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.range_bins.count_piece` by ``range_count.c``: ``x`` a 1-D CPU tensor, ``scale`` a () one.

    Any float dtype (others than fp32, fp16 and bf16 go to fp32 first, as the other routes do); runs
    are not empty. The caller checks that :func:`native_counter` is not ``None`` first (``fn``: another
    build of the counter, for the tests).
    """
    fn = fn or native_counter()
    if x.dtype not in _DTYPES:
        x = x.float()
    x = x.contiguous()
    s = 1.0 if scale is None else float(scale)       # an fp32 value: no rounding (CPU: no sync)
    counts = torch.empty(len(runs) * N_BINS, dtype=torch.int64)
    amax = torch.empty(len(runs), dtype=torch.int32)
    lengths = torch.tensor(runs, dtype=torch.int64)
    fn(x.data_ptr(), _DTYPES[x.dtype], s, lengths.data_ptr(), len(runs), counts.data_ptr(), amax.data_ptr())
    return counts, amax.view(torch.float32)

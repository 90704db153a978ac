"""What a device can run: capability probes that return a reason instead of raising.

Nothing here runs at import; every probe looks at the hardware when it is called.

    >>> from mixprec import get_recipe
    >>> supports(get_recipe("tf32"), torch.device("cpu")).reason
    'tf32 needs an NVIDIA GPU of compute capability 8.0 (Ampere) or later; cpu has no TF32 mode: use fp32'
    >>> supports(get_recipe("bf16"), torch.device("cpu"))
    Support(ok=True, reason='')
"""

from __future__ import annotations

import functools
import platform
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .recipe import Precision, Recipe, get_recipe

__all__ = ["Support", "supports", "probe_scaled_mm", "probe_fp8_kernel", "Fp8Speed", "probe_fp8_speed", "resolve_device",
           "device_name"]

_CUDA_FP8_CAPABILITY = (8, 9)   # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores


class Support(NamedTuple):
    ok: bool
    reason: str = ""


def supports(recipe: Recipe | str, device: torch.device | str) -> Support:
    """Whether ``device`` can run ``recipe``, and if not, why (with what to use instead).

    ``recipe`` is a Recipe, a recipe name or a recipe string (``"fp16"``, ``"params=bf16,..."``);
    ``device`` a torch.device or a device string (``"cpu"``, ``"cuda:0"``). TypeError/ValueError for
    anything else: a question that cannot be asked is not answered with a reason.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)      # an unknown name is a ValueError that lists the valid ones
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"supports() takes a Recipe or a recipe name such as 'fp16' or 'bf16-pure', got "
                        f"{type(recipe).__name__} {recipe!r}")
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"supports() takes a torch.device or a device string such as 'cpu' or 'cuda:0', got "
                        f"{type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{device!r} is not a device: give a device string such as 'cpu', 'cuda' or "
                         f"'cuda:0' ({e})") from None
    compute = recipe.compute
    if compute is Precision.TF32:
        if device.type != "cuda":
            return Support(False, f"tf32 needs an NVIDIA GPU of compute capability 8.0 (Ampere) or later; "
                                  f"{device.type} has no TF32 mode: use fp32")
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return Support(False, f"tf32 needs compute capability 8.0 or later; {device} is {major}.{minor}: "
                                  "use fp32")
    if compute.is_low:
        if not torch.amp.is_autocast_available(device.type):
            return Support(False, f"torch.autocast does not support device type {device.type!r}: "
                                  "use fp32")
        if compute is Precision.BF16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return Support(False, f"{device} has no bf16 support (it needs compute capability 8.0, "
                                  "Ampere, or later): use fp16")
    if recipe.fp8 is not None and recipe.fp8.backend == "scaled_mm":
        # backend=auto runs anywhere (emulated where torch._scaled_mm cannot); scaled_mm was demanded.
        for scaling in recipe.fp8.scalings:        # the leading scaling and every layers= rule's
            fp8 = probe_fp8_kernel(scaling.value, device)
            if not fp8.ok:
                return Support(False, f"{fp8.reason}: use fp8 backend=auto (emulates) or a bf16 recipe")
    return Support(True)


@functools.lru_cache(maxsize=None)
def _probe(device: str) -> Support:
    if not hasattr(torch, "_scaled_mm"):
        return Support(False, f"torch {torch.__version__} has no torch._scaled_mm")
    dev = torch.device(device)
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if cap < _CUDA_FP8_CAPABILITY:
            return Support(False, f"{dev} is compute capability {cap[0]}.{cap[1]}; fp8 matmuls need 8.9 "
                                  "(Ada) or 9.0 (Hopper) or later")
    try:
        one = torch.ones((), device=dev)
        a = torch.ones(16, 16, device=dev).to(torch.float8_e5m2)       # the backward's e5m2 x e4m3
        b = torch.ones(16, 16, device=dev).to(torch.float8_e4m3fn).t()
        for out_dtype in (torch.float32, torch.bfloat16):
            out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out_dtype)
            if float(out[0, 0]) != 16.0:   # the probe's one host sync
                return Support(False, f"torch._scaled_mm on {dev} gave a wrong result")
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return Support(False, f"torch._scaled_mm does not run on {dev} with this torch build "
                              f"({str(exc).splitlines()[0][:120]})")
    return Support(True)


def probe_scaled_mm(device: torch.device | str) -> Support:
    """Whether ``torch._scaled_mm`` runs fp8 (e4m3 and e5m2) matmuls on ``device``, and if not, why.

    Runs one tiny matmul the first time a device is asked about (one host sync); cached afterwards.
    The probe always runs on real tensors: asked inside a fake-tensor trace (``memory_report``,
    ``inspect``) it steps out of the trace's dispatch modes for that matmul, where a fake result
    would read as "no fp8 here" and that verdict would be cached for the whole process.
    """
    # _disable_current_modes pops every TorchDispatchMode (FakeTensorMode among them) for the block
    # and restores them after; outside any mode it does nothing.
    with _disable_current_modes():
        return _probe(str(torch.device(device)))


_NO_KERNEL = {"mxfp8": "MXFP8", "nvfp4": "NVFP4"}


def probe_fp8_kernel(scaling: str, device: torch.device | str) -> Support:
    """Whether ``device`` runs the scaled-matmul kernel of an fp8 scaling (``Fp8Scaling`` value), and if not, why.

    current/delayed: ``probe_scaled_mm``; rowwise: the same with (M, 1) and (1, N) fp32 scales; block:
    ``torch.nn.functional.scaled_mm`` with 1x128 and 128x128 scales, compute capability 9.x only
    (cuBLASLt's DeepSeek-style kernels); ``"grouped"`` (a mixture of experts' forward GEMM, fp8/grouped.py):
    ``torch._scaled_grouped_mm`` with e4m3 operands and row scales, CUDA 9.x only (torch has no other
    kernel for it); mxfp8, nvfp4: their kernels need Blackwell (10.x) and packed
    scale layouts mixprec does not build: never. One tiny matmul per device and kind, cached.
    """
    if scaling in _NO_KERNEL:
        return Support(False, f"{_NO_KERNEL[scaling]} matmul kernels need an NVIDIA Blackwell GPU (compute "
                              f"capability 10.x) and mixprec does not call them yet")
    support = probe_scaled_mm(device)
    if not support.ok or scaling in ("current", "delayed"):
        return support
    with _disable_current_modes():
        return _probe_kernel(str(torch.device(device)), scaling)


@functools.lru_cache(maxsize=None)
def _probe_kernel(device: str, scaling: str) -> Support:
    dev = torch.device(device)
    if scaling == "block" and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9
                               or not hasattr(torch.nn.functional, "scaled_mm")):
        return Support(False, "128-block fp8 matmuls (torch.nn.functional.scaled_mm, BlockWise1x128/128x128) "
                              "run on CUDA compute capability 9.x (Hopper) only")
    if scaling == "grouped":
        return _probe_grouped(dev)
    try:
        n = 128 if scaling == "block" else 16
        a = torch.ones(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.ones(n, n, device=dev).to(torch.float8_e4m3fn).t()         # column-major
        for out_dtype in (torch.float32, torch.bfloat16):
            if scaling == "block":          # both pairs fp8=block runs: 1x128 by 128x128, and 1x128 by 1x128
                from torch.nn.functional import ScalingType
                one = torch.ones(n, 1, device=dev)                               # (n, n/128), stride (1, n)
                tile = torch.ones(4, 1, device=dev)                              # (round_up(1, 4), n/128)
                out = torch.nn.functional.scaled_mm(a, b, one, ScalingType.BlockWise1x128, tile,
                                                    ScalingType.BlockWise128x128, output_dtype=out_dtype)
                out = out + torch.nn.functional.scaled_mm(a, b, one, ScalingType.BlockWise1x128, one,
                                                          ScalingType.BlockWise1x128, output_dtype=out_dtype)
                out = out / 2
            else:
                out = torch._scaled_mm(a, b, scale_a=torch.ones(n, 1, device=dev),
                                       scale_b=torch.ones(1, n, device=dev), out_dtype=out_dtype)
            if float(out[0, 0]) != n:            # the probe's one host sync
                return Support(False, f"the {scaling} fp8 matmul on {dev} gave a wrong result")
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        return Support(False, f"the {scaling} fp8 matmul does not run on {dev} with this torch build "
                              f"({str(exc).splitlines()[0][:120]})")
    return Support(True)


def _probe_grouped(dev: torch.device) -> Support:
    """``torch._scaled_grouped_mm`` on two groups of 16 rows: e4m3 ones, row scales of 1 and 2."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9 \
            or not hasattr(torch, "_scaled_grouped_mm"):
        return Support(False, "grouped fp8 matmuls (torch._scaled_grouped_mm) run on CUDA compute capability "
                              "9.x (Hopper) only")
    try:
        a = torch.ones(32, 16, device=dev).to(torch.float8_e4m3fn)                      # (S, K) row-major
        b = torch.ones(2, 16, 16, device=dev).to(torch.float8_e4m3fn).transpose(1, 2)   # (E, K, N) column-major
        scale_b = torch.tensor([[1.0] * 16, [2.0] * 16], device=dev)                    # (E, N)
        out = torch._scaled_grouped_mm(a, b, torch.ones(32, device=dev), scale_b,
                                       offs=torch.tensor([16, 32], dtype=torch.int32, device=dev),
                                       out_dtype=torch.bfloat16)
        if out[0, 0].item() != 16 or out[31, 15].item() != 32:     # the probe's one host sync
            return Support(False, f"the grouped fp8 matmul on {dev} gave a wrong result")
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        return Support(False, f"the grouped fp8 matmul does not run on {dev} with this torch build "
                              f"({str(exc).splitlines()[0][:120]})")
    return Support(True)


class Fp8Speed(NamedTuple):
    """One fp8 matmul timed both ways on a device: ``torch._scaled_mm`` and the emulation's fp32 mm."""

    scaled_mm_s: float    # the fastest of the timed torch._scaled_mm calls, seconds
    emulate_s: float      # the fastest of the emulation's calls (fp8 -> fp32, fp32 mm, scales, round)
    size: int             # M = K = N of the timed matmul

    @property
    def ratio(self) -> float:
        """How many times the emulation's time ``torch._scaled_mm`` takes (above 1: slower)."""
        return self.scaled_mm_s / max(self.emulate_s, 1e-9)


_SPEED_SIZE = 32          # M = K = N: 32k multiply-adds, microseconds for any real kernel
_SPEED_REPS = 3           # interleaved calls of each; the minimum is compared (noise only adds time)
_SPEED_ENOUGH_S = 1e-3    # a scaled_mm call this slow, and 4x the emulation, decides it at once


@functools.lru_cache(maxsize=None)
def _time_fp8(device: str) -> Fp8Speed:
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(_SPEED_SIZE, _SPEED_SIZE, generator=g).to(dev).to(torch.float8_e4m3fn)
    b = torch.randn(_SPEED_SIZE, _SPEED_SIZE, generator=g).to(dev).to(torch.float8_e4m3fn).t()  # col-major
    one = torch.ones((), device=dev)

    def emulate() -> torch.Tensor:     # what fp8/matmul.py's emulated_mm does, from fp8 values
        # Autocast off: asked inside a user's autocast region, this fp32 mm would run in bf16.
        with torch.autocast(dev.type, enabled=False):
            return (torch.mm(a.float(), b.float()) * one * one).to(torch.bfloat16)

    def scaled() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        start = time.perf_counter()
        fn()                           # CPU kernels return when done: no sync needed
        return time.perf_counter() - start

    # One thread while timing: on a loaded machine a 2-thread matmul of a few microseconds can wait
    # tens of milliseconds at an OpenMP barrier for a descheduled sibling (2 cores, load 4: 37 ms
    # against 0.005 ms); single-threaded the minimum of three is steady. Restored after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        emulate()                      # warm-up; scaled_mm's first call is timed (the min forgives it)
        t_sm: list[float] = [timed(scaled)]
        t_em: list[float] = []
        for _ in range(_SPEED_REPS):
            t_em.append(timed(emulate))
            t_sm.append(timed(scaled))
            # A reference-loop kernel (e.g. 0.4 s per 128^3 matmul on one Intel CPU with AMX, torch
            # 2.13) is told apart by two calls: stop there rather than spend more on it. Two, so
            # that one call preempted on a loaded machine does not decide it.
            if min(t_sm) > _SPEED_ENOUGH_S and min(t_sm) > 4 * min(t_em):
                break
    finally:
        torch.set_num_threads(threads)
    return Fp8Speed(min(t_sm), min(t_em), _SPEED_SIZE)


def probe_fp8_speed(device: torch.device | str) -> Fp8Speed | None:
    """On a CPU whose torch runs ``torch._scaled_mm``: one fp8 matmul timed with it and emulated.

    torch's CPU fp8 kernel is a oneDNN path on some CPUs and a slow reference loop on others (40x
    the emulation on an Intel CPU with AMX); only a measurement tells. A few interleaved 32x32x32
    matmuls, well under a millisecond where the kernel is sound; cached per device for the process.
    ``None`` where nothing is measured: on CUDA the fp8 tensor cores are what fp8 is for (and a
    matmul this small would time the launch, not the kernel), and where ``_scaled_mm`` cannot run.
    """
    dev = torch.device(device)
    if dev.type != "cpu" or not probe_scaled_mm(dev).ok:
        return None
    with _disable_current_modes():     # real tensors, even asked inside a fake-tensor trace
        return _time_fp8(str(dev))


def resolve_device(word: str | None) -> torch.device:
    """``None``/``"auto"`` -> cuda if available else cpu; otherwise the named device, checked to exist."""
    if word in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(word)
    except RuntimeError:
        raise ValueError(f"unknown device {word!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {word!r} asked for, but this torch build sees no CUDA GPU; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {word!r} asked for, but only {torch.cuda.device_count()} CUDA GPU(s) are "
                         f"visible (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return device


def device_name(device: torch.device) -> str:
    """A readable name for reports: the GPU's model, or the CPU's architecture."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{platform.machine() or 'unknown'} CPU"
    return device.type

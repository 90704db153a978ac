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
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .recipe import Precision, Recipe

__all__ = ["Support", "supports", "probe_scaled_mm", "resolve_device", "device_name"]

_CUDA_FP8_CAPABILITY = (8, 9)   # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores


class Support(NamedTuple):
    ok: bool
    reason: str = ""


def supports(recipe: Recipe, device: torch.device | str) -> Support:
    """Whether ``device`` can run ``recipe``, and if not, why (with what to use instead)."""
    device = torch.device(device)
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
        fp8 = probe_scaled_mm(device)
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

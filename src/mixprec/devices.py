"""What a device can run: capability probes that return a reason instead of raising.

Nothing here runs at import; every probe looks at the hardware when it is called.

    >>> from mixprec import get_recipe
    >>> supports(get_recipe("tf32"), torch.device("cpu")).reason
    'tf32 needs an NVIDIA GPU of compute capability 8.0 (Ampere) or later; cpu has no TF32 mode: use fp32'
    >>> supports(get_recipe("bf16"), torch.device("cpu"))
    Support(ok=True, reason='')
"""

from __future__ import annotations

import platform
from typing import NamedTuple

import torch

from .recipe import Precision, Recipe

__all__ = ["Support", "supports", "resolve_device", "device_name"]


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
        from .fp8.matmul import probe_scaled_mm   # here: fp8.matmul imports this module's Support
        fp8 = probe_scaled_mm(device)
        if not fp8.ok:
            return Support(False, f"{fp8.reason}: use fp8 backend=auto (emulates) or a bf16 recipe")
    return Support(True)


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

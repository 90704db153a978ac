"""Which matmul runs an fp8 recipe's layers: ``torch._scaled_mm`` or the emulation, per scaling.

``resolve_backend`` decides for one scaling (``backend=auto`` picks the faster where the kernel runs);
``resolve_backends`` for every scaling a recipe gives a layer (``layers=`` rules mix them), and
``backend_per_scaling`` turns either into the ``{Fp8Scaling: word}`` map ``swap_to_fp8`` builds from::

    backends, note = resolve_backends(Fp8Config.parse("rowwise(layers=lm_head:mxfp8)"), "cpu")
    backends[Fp8Scaling.MXFP8]          # "emulate": mxfp8's kernel needs Blackwell
"""

from __future__ import annotations

import torch

from ..devices import probe_fp8_kernel, probe_fp8_speed
from ..recipe.fp8 import Fp8Config

__all__ = ["resolve_backend", "resolve_backends", "backend_per_scaling", "Fp8EmulationWarning"]


class Fp8EmulationWarning(UserWarning):
    """An fp8 recipe runs emulated (exact fp8 rounding, fp32 matmuls) on a device without fp8 matmuls."""

# backend=auto keeps torch._scaled_mm unless the measured probe finds it more than this many times
# slower than the emulation. A sound kernel measures about 1.1x on a CPU (AMD Zen 5, torch 2.13: the
# casts around the matmuls then decide the step, within 15% either way); a reference loop measures
# hundreds. The margin keeps the choice, and so the numbers, the same run to run on a loaded machine.
_SLOWER_THAN_EMULATION = 2.0


def resolve_backend(config: Fp8Config, device: torch.device | str) -> tuple[str, str]:
    """``(backend, note)`` for ``device``: ``auto`` picks the faster of scaled_mm and the emulation.

    ``auto``: the emulation where the scaling's kernel cannot run (``devices.probe_fp8_kernel``: mxfp8
    and nvfp4 always, their kernels need Blackwell; block off Hopper); on a CPU where it runs
    (per-tensor, rowwise), whichever a measured probe finds faster (``devices.probe_fp8_speed``: under
    a millisecond, once per process); on CUDA (8.9+; block: 9.x) the kernel. ``backend=scaled_mm``
    or ``backend=emulate`` overrides the choice; ``scaled_mm`` on a device that cannot run it is a
    ValueError with the reason. The note names the choice and why; the engine shows it once, as an
    ``Fp8EmulationWarning`` (defined here; ``mixprec.Fp8EmulationWarning``), when the emulation runs.
    """
    if config.backend == "emulate":
        return "emulate", ""
    support = probe_fp8_kernel(config.scaling.value, device)
    if support.ok and config.backend == "scaled_mm":
        return "scaled_mm", ""
    what = "fp8" if not config.blocked else f"fp8={config.scaling.value}"
    if not support.ok:
        if config.backend == "scaled_mm":
            raise ValueError(f"{what} backend=scaled_mm cannot run on {device}: {support.reason}; use "
                             "backend=auto or backend=emulate")
        return "emulate", (f"{what} is emulated on {device} (exact rounding, fp32 matmuls, no speed-up): "
                           f"{support.reason}")
    if config.scaling.value == "block":
        return "scaled_mm", ""                    # Hopper's block kernels: what fp8=block is for
    # Per-tensor and rowwise on a CPU: the one measured probe (a per-tensor fp8 matmul; the rowwise
    # kernel costs the same within noise: benchmarks/HISTORY.md) decides both.
    speed = probe_fp8_speed(device)
    if speed is None:
        return "scaled_mm", ""
    measured = (f"a {speed.size}x{speed.size}x{speed.size} fp8 matmul took {speed.scaled_mm_s * 1e3:.3f} ms "
                f"with torch._scaled_mm, {speed.emulate_s * 1e3:.3f} ms emulated")
    if speed.ratio > _SLOWER_THAN_EMULATION:
        return "emulate", (f"fp8 is emulated on {device} (exact fp8 rounding, fp32 matmuls): torch._scaled_mm "
                           f"runs here but measured {speed.ratio:.0f}x slower ({measured}); "
                           "fp8=...(backend=scaled_mm) forces it")
    return "scaled_mm", (f"torch._scaled_mm chosen on {device} by a measured probe ({measured}); "
                         "fp8=...(backend=emulate) overrides it")


def backend_per_scaling(config: Fp8Config, backend: str | dict) -> dict:
    """``{Fp8Scaling: "scaled_mm" | "emulate"}`` for every scaling ``config`` gives a layer: one word for
    all, or the engine's choice per scaling (``resolve_backends``)."""
    if isinstance(backend, str):
        return dict.fromkeys(config.scalings, backend)
    missing = [s.value for s in config.scalings if s not in backend]
    if missing:
        raise ValueError(f"no backend given for fp8 scalings {missing}; pass one word or resolve_backends()")
    return dict(backend)


def resolve_backends(config: Fp8Config, device: torch.device | str) -> tuple[dict, str]:
    """``resolve_backend`` for each scaling ``config`` gives a layer (``layers=`` rules included):
    ``({Fp8Scaling: backend}, notes)``. An error names the rule's layers that cannot run."""
    backends, notes = {}, []
    for scaling in config.scalings:
        try:
            backends[scaling], note = resolve_backend(config.only(scaling), device)
        except ValueError as exc:
            rules = [p for p, s in config.layers if s is scaling]
            if scaling is config.scaling or not rules:
                raise
            raise ValueError(f"fp8 layers={'+'.join(f'{p}:{scaling.value}' for p in rules)}: {exc}") from None
        if note and note not in notes:
            # The emulation's notices first: the engine's warning leads with what runs emulated.
            notes.insert(0 if backends[scaling] == "emulate" else len(notes), note)
    return backends, "; ".join(notes)

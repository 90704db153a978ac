"""Per-layer fp8 underflow and saturation, read from the scales (and, when asked, counted exactly).

Every fp8 linear keeps, for its input, weight and output gradient, the scale of its last training
cast and that tensor's amax. From them: the **headroom** ``log2(F.max / (amax * scale))`` in bits
(negative: the largest values saturated at F.max; large: the top of the range is wasted and small
values flush), and the **flush threshold** ``F.min_subnormal / 2 / scale``: magnitudes at or below it
became 0. With ``count_fp8_ranges(model)`` on, every training cast also counts exactly how many values
flushed to zero and how many saturated (a few extra element-wise passes, so it is off by default)::

    count_fp8_ranges(model)              # optional: exact counts from now on
    ... train a few steps ...
    for layer in fp8_layer_stats(model):
        print(layer.name, [(t.role, t.headroom_bits, t.saturated_fraction) for t in layer.tensors])

``mixprec doctor`` can call ``fp8_layer_stats``; it is typed data, rendered elsewhere.

Blocked layers (``fp8=rowwise | block | mxfp8 | nvfp4``) have a scale per block, not per tensor. Their
stats keep the same fields, read so: ``amax`` is the tensor's, ``format`` its element format (e.g.
``fp4_e2m1``), ``scale`` the one the block scale rule gives the block that holds the amax (its
headroom is then the rule's own: 0 bits for fp32 scales, 0 to 1 for power-of-two ones, within an
e4m3 rounding of 0 for nvfp4) and ``flush_below`` that block's threshold (every other block has its
own, lower one); the exact ``flushed_fraction``/``saturated_fraction`` count every block at its scale.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .blockscale import BlockScaling, quantize_blocked
from .linear import ROLES
from .state import fp8_layers

__all__ = ["Fp8TensorStats", "Fp8LayerStats", "fp8_layer_stats", "count_fp8_ranges"]


@dataclasses.dataclass(frozen=True)
class Fp8TensorStats:
    """One scaled tensor of one fp8 layer, as of its last training cast."""

    role: str                         # "input", "weight" or "grad_output"
    format: str                       # "fp8_e4m3" or "fp8_e5m2"
    scale: float                      # x is cast as x * scale
    amax: float                       # max |x| of that cast (inf/NaN if x held them; 0 before any cast)
    history_amax: float | None        # max of the amax history (delayed scaling), else None
    headroom_bits: float              # log2(F.max / (amax * scale)); < 0: saturated; inf: amax 0; NaN: NaN seen
    flush_below: float                # |x| <= this became 0 in fp8
    flushed_fraction: float | None    # exact share of the values cast while counting; None if not counted
    saturated_fraction: float | None
    counted: int                      # values counted (0 when counting was off)

    @property
    def saturates(self) -> bool:
        """True when the last cast clipped its largest values to the format's max."""
        return self.headroom_bits < 0


@dataclasses.dataclass(frozen=True)
class Fp8LayerStats:
    """An fp8 linear layer's qualified name, weight shape and its three tensors' stats."""

    name: str
    out_features: int
    in_features: int
    tensors: tuple[Fp8TensorStats, ...]

    def tensor(self, role: str) -> Fp8TensorStats:
        """The stats of ``role`` ("input", "weight" or "grad_output")."""
        for t in self.tensors:
            if t.role == role:
                return t
        raise ValueError(f"unknown fp8 tensor role {role!r}; valid roles: {', '.join(ROLES)}")


def count_fp8_ranges(model: nn.Module, enabled: bool = True, *, reset: bool = True) -> int:
    """Turn exact flush/saturation counting on (or off) in every fp8 layer; returns how many layers.

    ``reset`` zeroes the counts gathered so far. Counting costs a few element-wise passes per cast.
    """
    layers = fp8_layers(model)
    for layer in layers.values():
        layer.count_ranges = enabled
        if reset:
            for role in ROLES:
                getattr(layer, f"{role}_counts").zero_()
    return len(layers)


@torch.no_grad()
def fp8_layer_stats(model: nn.Module) -> tuple[Fp8LayerStats, ...]:
    """Scales, amaxes, headroom, flush thresholds and (if counted) exact fractions for every fp8 layer.

    One host sync for the whole model. An empty tuple when the model has no fp8 layers.
    """
    layers = fp8_layers(model)
    if not layers:
        return ()
    rows = []   # per layer and role: scale, amax, history max (or NaN), flushed, saturated, total
    for layer in layers.values():
        for role in ROLES:
            hist = getattr(layer, f"{role}_history", None)
            counts = getattr(layer, f"{role}_counts").to(torch.float64)
            amax = getattr(layer, f"{role}_amax")
            nan = torch.tensor(math.nan, device=counts.device)
            rows.append(torch.cat([
                torch.stack([getattr(layer, f"{role}_scale", nan), amax,   # blocked: no tensor scale
                             hist.amax() if hist is not None else nan]).to(torch.float64), counts]))
    values = torch.stack(rows).cpu().tolist()    # the one host sync
    out, i = [], 0
    for name, layer in layers.items():
        tensors = []
        for role, fmt in layer.fp8_formats().items():
            scale, amax, hist_amax, flushed, saturated, total = values[i]
            i += 1
            if layer.blocked is not None:
                scale = _amax_block_scale(amax, layer.blocked.role(role))
            scaled = amax * scale
            if math.isnan(scaled) or scaled == 0:
                headroom = math.nan if math.isnan(scaled) else math.inf    # NaN seen / nothing cast yet
            else:
                headroom = math.log2(fmt.max / scaled)                      # -inf for an inf amax
            tensors.append(Fp8TensorStats(
                role=role, format=fmt.name, scale=scale, amax=amax,
                history_amax=None if math.isnan(hist_amax) else hist_amax,
                headroom_bits=headroom, flush_below=fmt.min_subnormal / 2 / scale,
                flushed_fraction=flushed / total if total else None,
                saturated_fraction=saturated / total if total else None, counted=int(total)))
        out.append(Fp8LayerStats(name, layer.out_features, layer.in_features, tuple(tensors)))
    return tuple(out)


def _amax_block_scale(amax: float, how: BlockScaling) -> float:
    """The encode scale (``1 / decode``) the block scale rule gives a block whose amax is ``amax``:
    that of the block holding the tensor's amax (for nvfp4 its tensor scale is this amax, too). 1.0 when
    nothing usable was cast (amax 0, inf or NaN), as per-tensor scaling's fallback."""
    if not (math.isfinite(amax) and amax > 0):
        return 1.0
    _, decode = quantize_blocked(torch.tensor([[amax]], dtype=torch.float32), how, 1)
    return 1.0 / float(decode.reshape(-1)[0])

"""fp8 scale state of a whole model: collected per layer for checkpoints, restored bit for bit.

Per layer it is whatever ``Fp8Linear.fp8_state()`` holds: per-tensor scaling's scales, amaxes,
histories and range counts; a blocked layer's amaxes and range counts, and for nvfp4 the stochastic
rounding's seed and backward count and the Hadamard signs (so a resumed run draws the same noise).

    state = fp8_state_dict(model)        # {"blocks.0.mlp.c_fc": {"input_scale": ..., ...}, ...}
    load_fp8_state_dict(model, state)    # ValueError if layers or shapes do not match
"""

from __future__ import annotations

import torch
from torch import nn

from .layer_state import Fp8LayerState

__all__ = ["fp8_layers", "fp8_state_dict", "load_fp8_state_dict"]


def fp8_layers(model: nn.Module) -> dict[str, Fp8LayerState]:
    """The model's fp8 layers (linears and grouped expert GEMMs) by qualified name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8LayerState)}


def fp8_state_dict(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of every fp8 layer's scale state (scales, last amaxes, histories, range counts)."""
    return {name: layer.fp8_state() for name, layer in fp8_layers(model).items()}


def load_fp8_state_dict(model: nn.Module, state: dict[str, dict[str, torch.Tensor]] | None) -> None:
    """Restore ``fp8_state_dict``'s output into the same fp8 layers; a mismatch is a ValueError."""
    layers = fp8_layers(model)
    if state is None or set(state) != set(layers):
        saved = sorted(state) if state is not None else "none"
        raise ValueError(f"fp8 state holds layers {saved}, the model's fp8 layers are {sorted(layers)}: "
                         "build the model and the fp8 recipe as they were when the state was saved")
    for name, layer in layers.items():
        try:
            layer.load_fp8_state(state[name])
        except ValueError as exc:
            raise ValueError(f"fp8 layer {name!r}: {exc}") from None

"""fp32 weights out of a model trained under any recipe: for ``save_pretrained``, serving, fine-tuning.

Under a pure recipe the model holds fp16/bf16 weights and the optimizer steps fp32 master copies; the
masters are the weights (the 16-bit ones are their rounding). ``fp32_state_dict(engine)`` is the
model's ``state_dict()`` with every low-precision parameter replaced by its fp32 master, and every
other floating tensor upcast to fp32 (exact: fp16 and bf16 values are fp32 values). bf16-sr keeps no
master: its bf16 weights are the weights, upcast. Tied weights stay tied (one tensor, two keys), so
Hugging Face's ``save_pretrained(dir, state_dict=...)`` still recognises them::

    model.save_pretrained(out_dir, state_dict=fp32_state_dict(mp))

Copies only what is not fp32 already; no host sync beyond the copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..engine import MixedPrecision

__all__ = ["fp32_state_dict"]


def fp32_state_dict(engine: MixedPrecision) -> dict[str, torch.Tensor]:
    """The engine's model's ``state_dict`` in fp32, master copies in place of 16-bit weights (under
    bf16-kahan each weight joined with its compensation: the exact fp32 value the optimizer stepped)."""
    masters: dict[int, torch.Tensor] = {}
    if engine.master is not None:
        engine.master.adopt_model_changes()     # a weight the user changed is the truth
    if engine.master is not None and engine.master.keep:
        masters = {id(p): m.detach() for p, m in zip(engine.master.model_params, engine.master.masters)}
    elif (kahan := getattr(engine.master, "kahan", None)) is not None:    # bf16-kahan: weight + compensation
        masters = {id(p): w for p, w in zip(kahan.params, kahan.fp32_weights())}
    # keep_vars: the Parameters themselves, so they can be matched to their masters by identity.
    state = engine.model.state_dict(keep_vars=True)
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        if id(value) not in made:
            if id(value) in masters:
                made[id(value)] = masters[id(value)]
            elif value.is_floating_point() and value.dtype != torch.float32:
                made[id(value)] = value.detach().float()
            else:
                made[id(value)] = value.detach()
        out[key] = made[id(value)]
    return out

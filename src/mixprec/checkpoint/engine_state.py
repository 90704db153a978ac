"""The engine's own state: what ``MixedPrecision.state_dict`` gives and ``load_state_dict`` restores, and
fp32 model weights loaded at fp32 precision (``load_model_state_dict``).

The engine's state is the recipe, the loss scale, the fp32 copies (master weights, bf16-sr's rounding
noise, bf16-kahan's compensations), every fp8 layer's scale state and the compact Adam moments; the model's
and the optimizer's own state dicts are theirs (``files.save_checkpoint`` saves all of it together). A
state is checked whole against the engine first (``check.check_engine_state``), so a misfit is a
ValueError that changes nothing.

Loading fp32 weights through ``model.load_state_dict`` alone would round them into the 16-bit weights
first, and the masters would start from that rounding: ``load_model_state`` puts each fp32 value into
its master (under bf16-kahan the weight and its compensation: the exact fp32 value) and the 16-bit weight
its rounding, as if the optimizer had stepped there.

The engine's methods of these names call these functions; nothing else here keeps state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..fp8.state import fp8_state_dict, load_fp8_state_dict
from .check import check_engine_state

if TYPE_CHECKING:
    from ..engine import MixedPrecision

__all__ = ["engine_state_dict", "load_engine_state", "load_model_state"]


def engine_state_dict(mp: MixedPrecision) -> dict[str, Any]:
    """``mp.state_dict()``: everything mixprec owns, one entry per part (None where the recipe has none)."""
    return {"recipe": str(mp.recipe), "loss_scale": mp.loss_scale.state_dict(),
            "master": mp.master.state_dict() if mp.master is not None else None,
            "fp8": fp8_state_dict(mp.model) if mp.fp8_report is not None else None,
            "moments": mp.moments.state_dict() if mp.moments is not None else None}


def load_engine_state(mp: MixedPrecision, state: dict[str, Any]) -> None:
    """``mp.load_state_dict(state)``: all of it checked first, then each part loaded."""
    check_engine_state(mp, state)     # recipe, loss scale, masters, fp8: all checked first
    mp.loss_scale.load_state_dict(state["loss_scale"])
    if mp.master is not None:
        mp.master.load_state_dict(state["master"])
    if mp.fp8_report is not None:
        load_fp8_state_dict(mp.model, state["fp8"])
    if mp.moments is not None:
        mp.moments.load_state_dict(state["moments"])


def load_model_state(mp: MixedPrecision, state_dict: dict[str, Any], strict: bool = True) -> Any:
    """``mp.load_model_state_dict``: through the model (torch checks the keys and shapes), then each fp32
    value into its weight's fp32 copy (``MasterWeights.load_fp32_``); torch's result."""
    result = mp.model.load_state_dict(state_dict, strict=strict)
    if mp.master is not None:
        position = {id(p): i for i, p in enumerate(mp.master.model_params)}
        for key, param in mp.model.state_dict(keep_vars=True).items():
            if id(param) in position and key in state_dict:
                mp.master.load_fp32_(position[id(param)], state_dict[key])
    return result

"""Values no run can produce, refused when a checkpoint is loaded (``check.py``, ``optim.py`` call these).

``check.py`` and ``optim.py`` make sure a checkpoint fits: keys, shapes, dtypes, types. A file with a
valid checksum can still hold values that no training could have written, and that train wrong once loaded
(issue 33): a negative second moment (Adam's ``exp_avg_sq``, Adagrad's ``sum``: ``sqrt`` of it is NaN),
non-finite optimizer state, a loss scale outside the recipe's ``[floor, ceiling]``, a dynamic scale
whose ``clean_steps`` is at or past ``growth_interval`` (torch's update grows only on equality, so it
would never grow again), fp8 scales or amax histories that are not finite and positive, nvfp4 Hadamard signs other
than +-1, a Kahan compensation that no fp32 value splits into. Each check raises ``ValueError``
naming the field; nothing here writes anywhere. One pass over each tensor, at load time only.

    >>> check_moment_values("optimizer state 'exp_avg_sq' of parameter 0", "exp_avg_sq", torch.tensor([-1.0]))
    Traceback (most recent call last):
    ...
    ValueError: optimizer state 'exp_avg_sq' of parameter 0 holds a negative value (-1): a second moment is a running mean of squares, never negative: was the file edited?
"""

from __future__ import annotations

from typing import Any

import torch

from ..recipe.moments import FP8_BLOCK, Moments

__all__ = ["check_moment_values", "check_scale_limits", "check_fp8_values", "check_compact_moments",
           "check_kahan_pairs"]

# Per-parameter optimizer state that is a sum or running mean of squares (or of magnitudes): >= 0.
_NONNEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "exp_inf", "acc_delta"})
_EDITED = "was the file edited?"


def _first_bad(value: torch.Tensor, bad: torch.Tensor) -> str:
    return f"{value.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item():g}"


def check_moment_values(where: str, key: str, value: torch.Tensor) -> None:
    """A float state tensor of a torch optimizer: finite, and >= 0 where it is a second moment."""
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        raise ValueError(f"{where} holds a non-finite value ({_first_bad(value, ~finite)}): a step with "
                         f"non-finite gradients is skipped, so no run writes one: {_EDITED}")
    if key in _NONNEGATIVE and bool((value < 0).any()):
        raise ValueError(f"{where} holds a negative value ({_first_bad(value, value < 0)}): a second moment "
                         f"is a running mean of squares, never negative: {_EDITED}")


def check_scale_limits(loss_scale: Any, saved: dict[str, torch.Tensor]) -> None:
    """A dynamic scale inside the recipe's ``[floor, ceiling]``, its clean-step count below
    ``growth_interval`` and its hysteresis count at most ``hysteresis``. Others: nothing to check."""
    config = getattr(loss_scale, "config", None)
    if config is None or "clean_steps" not in saved:
        return
    value = float(saved["value"])
    if not config.floor <= value <= config.ceiling:
        raise ValueError(f"loss scale state 'value' is {value:g}, outside the recipe's [floor, ceiling] = "
                         f"[{config.floor:g}, {config.ceiling:g}] that the dynamic scale never leaves: "
                         f"{_EDITED} (or resume with the recipe's scale=dynamic(floor=,ceiling=) it ran with)")
    clean = int(saved["clean_steps"])
    if clean >= config.growth_interval:
        raise ValueError(f"loss scale state 'clean_steps' is {clean}, at or past growth_interval "
                         f"{config.growth_interval}: the update grows S when the count reaches the interval "
                         f"and restarts it, so a run never holds that (and S would never grow again): {_EDITED}")
    left = saved.get("hysteresis_left")
    if left is not None and int(left) > config.hysteresis:
        raise ValueError(f"loss scale state 'hysteresis_left' is {int(left)}, more than the recipe's "
                         f"hysteresis {config.hysteresis}: {_EDITED}")


def check_fp8_values(name: str, saved: dict[str, torch.Tensor]) -> None:
    """One fp8 layer's state: scales finite and positive, histories finite and >= 0, last amaxes >= 0
    (or non-finite: a skipped step's), counts >= 0, nvfp4's Hadamard signs exactly +-1."""
    for key, value in saved.items():
        where = f"fp8 layer {name!r} state {key!r}"
        if key == "rht_signs":
            if not bool(((value == 1) | (value == -1)).all()):
                raise ValueError(f"{where} holds values other than +1 and -1: the random Hadamard "
                                 f"transform's signs are +-1 (another value scales the gradients): {_EDITED}")
        elif value.is_floating_point():
            # The last amax is what the last cast saw, a skipped step's inf/NaN included (a diagnostic:
            # no scale is made from it; the history holds such an amax as 0). Histories and scales are.
            if not key.endswith("_amax") and not bool(torch.isfinite(value).all()):
                raise ValueError(f"{where} holds a non-finite value: a scale made from it would be "
                                 f"NaN or 0 at every later step: {_EDITED}")
            if key.endswith("_scale") and not bool((value > 0).all()):
                raise ValueError(f"{where} holds a value <= 0: a scale is positive: {_EDITED}")
            if bool((value < 0).any()):
                raise ValueError(f"{where} holds a negative value: an amax is a magnitude: {_EDITED}")
        elif value.dtype != torch.bool and bool((value < 0).any()) and key != "sr_seed":
            raise ValueError(f"{where} holds a negative count: {_EDITED}")


def check_compact_moments(compact: Any, saved: Any) -> None:
    """``moments=bf16|bf16-sr|fp8``: the engine's own AdamW state, checked whole before the restore
    (format, one entry per tensor, element counts, finite moments, ``exp_avg_sq`` >= 0)."""
    fix = "resume with the recipe and model it was saved under"
    if not isinstance(saved, dict) or saved.get("format") != compact.fmt.value:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"the checkpoint holds moments={got}, this engine runs moments={compact.fmt.value}: {fix}")
    order = [w for g in compact.optimizer.param_groups for w in g["params"]]
    states = saved.get("state")
    if not isinstance(states, (list, tuple)) or len(states) != len(order):
        n = len(states) if isinstance(states, (list, tuple)) else 0
        raise ValueError(f"the checkpoint holds compact moments for {n} tensors, the optimizer steps "
                         f"{len(order)}: {fix}")
    for i, (w, state) in enumerate(zip(order, states)):
        if state is None:
            continue
        if not isinstance(state, dict) or not {"exp_avg", "exp_avg_sq"} <= set(state):
            raise ValueError(f"compact moments of tensor {i} are not a dict with exp_avg and exp_avg_sq: {_EDITED}")
        n = compact._numel(w)
        expected = -(-n // FP8_BLOCK) * FP8_BLOCK if compact.fmt is Moments.FP8 else n
        for key in ("exp_avg", "exp_avg_sq"):
            where = f"compact moment {key!r} of tensor {i}"
            value = state[key]
            if compact.fmt is Moments.FP8:
                if not (isinstance(value, (tuple, list)) and len(value) == 2
                        and all(isinstance(t, torch.Tensor) for t in value)):
                    raise ValueError(f"{where} is not (fp8 codes, block scales): {_EDITED}")
                codes, scales = value
                if codes.numel() != expected or scales.numel() != expected // FP8_BLOCK:
                    raise ValueError(f"{where} holds {codes.numel()} codes, a tensor of shape "
                                     f"{tuple(w.shape)} needs {expected}: {fix}")
                if not bool((torch.isfinite(scales) & (scales > 0)).all()):
                    raise ValueError(f"{where}'s block scales are not all finite and positive: {_EDITED}")
                decoded = codes.reshape(-1).view(torch.float8_e4m3fn).float()
                check_moment_values(where, key, decoded)
            else:
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    raise ValueError(f"{where} is not a float tensor: {_EDITED}")
                if value.numel() != expected:
                    raise ValueError(f"{where} holds {value.numel()} elements, a tensor of shape "
                                     f"{tuple(w.shape)} needs {expected}: {fix}")
                check_moment_values(where, key, value)


def check_kahan_pairs(kahan: Any, saved_comp: Any, weights: list[torch.Tensor]) -> None:
    """bf16-kahan: each compensation is the residual of a value whose nearest bf16 is its weight.

    ``split_`` never gives a zero weight a negative compensation (a zero is never rounded up in
    magnitude), an inf weight a positive one (its value would be a NaN pattern), or a NaN weight any
    (NaNs are made canonical first). ``weights``: the checkpoint's own bf16 weights, in ``kahan``'s order.
    """
    if not isinstance(saved_comp, (list, tuple)):
        return      # the shape checks (KahanCompensation.check_state) say what is wrong with it
    for i, (w, c) in enumerate(zip(weights, saved_comp)):
        if not (isinstance(c, torch.Tensor) and isinstance(w, torch.Tensor) and c.shape == w.shape
                and w.dtype == torch.bfloat16 and c.dtype == torch.int16):
            continue
        mag = w.reshape(-1).view(torch.int16) & 0x7FFF
        c = c.reshape(-1).to(w.device)
        bad = ((mag == 0) & (c < 0)) | ((mag == 0x7F80) & (c > 0)) | ((mag > 0x7F80) & (c != 0))
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            raise ValueError(f"Kahan compensation {i} holds {int(c[k])} beside the weight "
                             f"{w.reshape(-1)[k].item():g} (element {k}): no fp32 value splits into that pair "
                             f"(joined, it would be a NaN): {_EDITED}")

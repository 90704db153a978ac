"""Does a checkpoint's ``torch.optim`` state fit the live optimizer and LR scheduler? Checked, never loaded.

``check_fits`` (``check.py``) calls these before anything is restored. torch's own ``load_state_dict``
checks little: ``Optimizer.load_state_dict`` takes an AdamW state into an SGD (and the next step dies
with ``KeyError: 'momentum'``), a scheduler takes any dict. So the saved state is compared with the live
objects: the optimizer's type, its param groups (count, sizes, numbering, each setting of the kind the
live one holds), and each parameter's state against what a throwaway optimizer of the same type and
saved settings keeps once stepped (``_probe``); the scheduler's type, keys and values the same way::

    check_optimizer(state, engine.optimizer, shapes)   # ValueError naming the first misfit, or None
    check_scheduler(state, scheduler, ignore_scheduler=False)

Nothing here writes to the live optimizer or scheduler; the probe steps its own one-element copy.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from .values import check_moment_values

__all__ = ["check_optimizer", "check_scheduler"]

# torch's optimizers whose per-parameter state tensors (momentum, moments) have the parameter's shape;
# others (Adafactor's factored moments, a user's own) may hold any shape, so only these are checked.
_ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                           "ASGD", "Rprop")


def check_optimizer(state: dict, optimizer: torch.optim.Optimizer, shapes: dict[int, torch.Size]) -> None:
    """Same optimizer type, same param groups (count, sizes, hyperparameter names), state shapes."""
    mine = type(optimizer).__name__
    saved_type = state.get("optimizer_type")    # absent in files written before it was recorded
    if saved_type is not None and saved_type != mine:
        raise ValueError(f"the checkpoint holds {saved_type} state but the engine's optimizer is {mine}: "
                         f"build the engine with a {saved_type} to resume this run")
    saved = state["optimizer"]
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= set(saved):
        raise ValueError("the optimizer state is not an Optimizer.state_dict(): was the file written "
                         "by save_checkpoint?")
    groups, own_groups = saved["param_groups"], optimizer.param_groups
    if not (isinstance(groups, (list, tuple)) and all(
            isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in groups)):
        raise ValueError("the optimizer's param_groups are not a list of dicts with 'params': was the file "
                         "written by save_checkpoint?")
    if len(groups) != len(own_groups):
        raise ValueError(f"the saved optimizer has {len(groups)} param groups, this one has "
                         f"{len(own_groups)}: build it with the same groups as the saved run")
    for i, (group, own) in enumerate(zip(groups, own_groups)):
        if len(group["params"]) != len(own["params"]):
            raise ValueError(f"param group {i} holds {len(group['params'])} parameters in the checkpoint "
                             f"and {len(own['params'])} here: was it saved from a different model?")
        # Files from before the type was recorded: another optimizer type shows as settings that
        # differ both ways (AdamW's betas, SGD's momentum). One way only is a torch version adding a
        # setting (its __setstate__ fills the default); initial_lr is added by LR schedulers.
        keys, own_keys = set(group) - {"params", "initial_lr"}, set(own) - {"params", "initial_lr"}
        if saved_type is None and keys - own_keys and own_keys - keys:
            what = saved_type or "an optimizer"
            raise ValueError(f"the checkpoint's optimizer was {what} with settings "
                             f"{_few(sorted(keys - own_keys))} that the engine's {mine} lacks, and "
                             f"without {_few(sorted(own_keys - keys))}: build the engine with the "
                             "optimizer type the run was saved with")
    _check_group_settings(groups, own_groups)
    if not isinstance(saved["state"], dict):
        raise ValueError(f"the optimizer's per-parameter state is a {type(saved['state']).__name__}, not "
                         "a dict: was the file written by save_checkpoint?")
    if mine not in _ELEMENTWISE_OPTIMIZERS:
        return
    params = [shapes[id(p)] for g in own_groups for p in g["params"]]   # state_dict's numbering
    kept = [_probe(optimizer, i, group, g) for i, (group, g) in enumerate(zip(groups, own_groups))]
    group_of = [i for i, g in enumerate(own_groups) for _ in g["params"]]
    for index, entry in saved["state"].items():
        if not (isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(params)):
            raise ValueError(f"the optimizer state refers to parameter {index!r}; this optimizer holds "
                             f"{len(params)}")
        if not isinstance(entry, dict):
            raise ValueError(f"the optimizer state of parameter {index} is a {type(entry).__name__}, not "
                             "a dict: was the file written by save_checkpoint?")
        _check_param_state(mine, index, entry, kept[group_of[index]], params[index])


def _check_group_settings(groups: list, own_groups: list) -> None:
    """Each saved group's ``params`` numbers the parameters 0..n-1 in order (what torch's state_dict
    writes and its load_state_dict maps by), and each setting is of the kind the live optimizer's is:
    a number where it holds a number (finite), a flag where a flag, a tuple of numbers of the same length."""
    ids = [i for g in groups for i in (g["params"] if isinstance(g.get("params"), (list, tuple)) else [None])]
    if not (all(type(i) is int for i in ids) and ids == list(range(len(ids)))):
        raise ValueError("the optimizer's param groups do not number their parameters 0, 1, 2, ... in "
                         "order as Optimizer.state_dict() writes: was the file edited?")
    for i, (group, own) in enumerate(zip(groups, own_groups)):
        for key, mine in own.items():
            if key in ("params", "param_names") or key not in group:
                continue
            problem = _kind_mismatch(group[key], mine)
            if problem:
                raise ValueError(f"param group {i}'s {key!r} is {group[key]!r} in the checkpoint, {problem} "
                                 f"(this optimizer's is {mine!r}): was the file edited?")


def _kind_mismatch(value: Any, mine: Any) -> str | None:
    """Why ``value`` cannot stand where the live optimizer holds ``mine``; None if it can."""
    if isinstance(mine, bool):
        return None if isinstance(value, bool) else "not True/False"
    if _is_number(mine) or (isinstance(mine, torch.Tensor) and mine.dim() == 0):
        return None if _is_finite_number(value) else "not a finite number"
    if isinstance(mine, (tuple, list)) and all(_is_number(v) for v in mine):
        ok = (isinstance(value, (tuple, list)) and len(value) == len(mine)
              and all(_is_finite_number(v) for v in value))
        return None if ok else f"not {len(mine)} finite numbers"
    if mine is None:   # foreach=None, fused=None, differentiable flags: None or a flag
        return None if value is None or isinstance(value, bool) else "not None/True/False"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.dtype.is_floating_point and bool(torch.isfinite(value))
    return _is_number(value) and math.isfinite(value)


def _probe(optimizer: torch.optim.Optimizer, index: int, saved_group: dict,
           own_group: dict) -> dict[str, Any] | None:
    """What an optimizer of this type, with the saved group's settings, keeps per parameter once stepped.

    Builds a throwaway optimizer on one zero parameter of the group's device and dtype, loads the saved
    group the way ``load_state_dict`` does (``__setstate__`` fills the settings a newer torch added)
    and steps it once: the constructor checks the settings' ranges (betas in [0, 1), lr >= 0), the
    step their types, so a setting torch would choke on at the next step() is refused here.
    None: an empty group.
    """
    if not own_group["params"]:
        return None
    live = own_group["params"][0]
    kind = type(optimizer).__name__
    settings = {k: v for k, v in saved_group.items() if k not in ("params", "param_names")}
    dummy = torch.zeros(1, device=live.device, dtype=live.dtype if live.is_floating_point() else torch.float32,
                        requires_grad=True)
    dummy.grad = torch.zeros_like(dummy)
    try:
        # The constructor validates what it takes (a group may hold more: AdamW's decoupled_weight_decay).
        takes = inspect.signature(type(optimizer).__init__).parameters
        probe = type(optimizer)([dummy], **{k: v for k, v in settings.items() if k in takes})
        probe.__setstate__({"state": probe.state, "param_groups": [{**settings, "params": [dummy]}]})
        lacks = sorted(set(own_group) - set(probe.param_groups[0]) - {"initial_lr", "param_names"})
        if lacks:
            raise ValueError(f"param group {index} lacks the settings {_few(lacks)} that {kind} steps with: "
                             "was the file edited?")
        probe.step()
    except ValueError as exc:
        if str(exc).startswith(f"param group {index} lacks"):
            raise
        raise ValueError(f"param group {index}'s settings are refused by {kind} ({_first_line(exc)}): "
                         "was the file edited?") from None
    except Exception as exc:   # a TypeError from the step's arithmetic on a string, a KeyError
        raise ValueError(f"param group {index}'s settings are refused by {kind} ({_first_line(exc)}): "
                         "was the file edited?") from None
    return probe.state[dummy]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _check_param_state(kind: str, index: int, entry: dict, kept: dict[str, Any] | None,
                       shape: torch.Size) -> None:
    """One parameter's saved state: empty (never stepped) or the same keys as ``kept``, each of its kind."""
    if not entry or kept is None:
        return
    if set(entry) != set(kept):
        missing, extra = sorted(set(kept) - set(entry)), sorted(set(entry) - set(kept))
        raise ValueError(f"optimizer state of parameter {index} holds {sorted(entry)}, a stepped {kind} with "
                         f"these settings keeps {sorted(kept)} (missing {_few(missing)}, unexpected "
                         f"{_few(extra)}): was it saved by another optimizer or edited?")
    for key, own in kept.items():
        value = entry[key]
        where = f"optimizer state {key!r} of parameter {index}"
        if own is None:
            continue
        if isinstance(own, torch.Tensor) and own.dim() == 0:    # step, mu_product, eta: a scalar
            real = (value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool
                    and math.isfinite(float(value))) if isinstance(value, torch.Tensor) else None
            if not (real or (real is None and _is_finite_number(value))):
                raise ValueError(f"{where} is {_describe(value)}, not a finite scalar: was the file edited?")
            if key == "step" and float(value) < 0:
                raise ValueError(f"{where} is {float(value)}, a negative step count: was the file edited?")
        elif isinstance(own, torch.Tensor):                      # moments: the parameter's shape
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise ValueError(f"{where} is {_describe(value)}, not a float tensor: was the file edited?")
            if value.shape != shape:
                raise ValueError(f"{where} has shape {tuple(value.shape)}, the parameter "
                                 f"{tuple(shape)}: was it saved from a different model?")
            check_moment_values(where, key, value)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{value!r} ({type(value).__name__})"


def check_scheduler(state: dict, scheduler: Any, ignore_scheduler: bool) -> None:
    """A scheduler passed where the file holds one (or ``ignore_scheduler``), of the saved type, with the
    same state keys and each value of the kind the live scheduler's is."""
    saved = state["scheduler"]
    if scheduler is not None and saved is None:
        raise ValueError("holds no LR scheduler state, but a scheduler was passed: load without "
                         "scheduler=, or resume from a checkpoint saved with one")
    if scheduler is None and saved is not None and not ignore_scheduler:
        kind = state.get("scheduler_type") or "an LR scheduler"
        raise ValueError(f"holds {kind} state but no scheduler was passed: pass scheduler=... to resume "
                         "it, or ignore_scheduler=True to drop it on purpose")
    kind, mine = state.get("scheduler_type"), type(scheduler).__name__
    if scheduler is not None and kind is not None and kind != mine:
        raise ValueError(f"holds {kind} state but the scheduler passed is a {mine}: pass a {kind}")
    if scheduler is None:
        return
    if not isinstance(saved, dict):
        raise ValueError(f"the LR scheduler state is a {type(saved).__name__}, not the dict "
                         "scheduler.state_dict() returns: was the file edited?")
    own = scheduler.state_dict()
    if set(saved) != set(own):
        raise ValueError(f"the {mine} state holds {_few(sorted(map(str, saved)))}, this {mine} keeps "
                         f"{_few(sorted(map(str, own)))}: build the scheduler as the run did")
    for key, value in own.items():
        problem = _same_kind(saved[key], value)
        if key == "lr_lambdas" and not problem:   # LambdaLR: None for a function, a dict for a callable object
            problem = next(("not None or a dict" for f in saved[key] if not (f is None or isinstance(f, dict))),
                           None)
        if problem:
            raise ValueError(f"the {mine} state {key!r} is {saved[key]!r}: {problem} (this scheduler's is "
                             f"{value!r}): was the file edited?")


def _same_kind(value: Any, mine: Any) -> str | None:
    """Why a scheduler state value cannot stand where the live scheduler holds ``mine``; None if it can."""
    if mine is None:
        return None
    if isinstance(mine, bool):
        return None if isinstance(value, bool) else "not True/False"
    if _is_number(mine):
        return None if _is_finite_number(value) else "not a finite number"
    if isinstance(mine, str):
        return None if isinstance(value, str) else "not a string"
    if isinstance(mine, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(mine):
            return f"not a list of {len(mine)}"
        return next((p for p in map(_same_kind, value, mine) if p), None)
    if isinstance(mine, dict):
        if not isinstance(value, dict) or set(value) != set(mine):
            return "not a dict with the same keys"
        return next((p for k in mine if (p := _same_kind(value[k], mine[k]))), None)
    return None


def _few(names: list[str], n: int = 5) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")

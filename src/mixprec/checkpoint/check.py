"""Does a loaded checkpoint fit the engine it is about to be restored into? Checked before anything moves.

``load_checkpoint`` restores six things (model, engine state, optimizer, scheduler, RNG, extras). If it
found a mismatch halfway, the model would already hold the new weights while the optimizer or the
master copy still held the old ones: a half-restored run that trains on without a word. So every
check runs first, on the loaded data and the engine's own shapes, and raises ``ValueError`` with the
problem and the fix; nothing here writes to the engine, the optimizer, the scheduler or the RNG::

    check_fits(state, engine, scheduler)     # ValueError naming the first misfit, or None
    ... then restore, knowing each load_state_dict will accept what it is given

Types and values are checked, not only shapes: each parameter's optimizer state holds exactly what a
throwaway optimizer of the same type and saved settings keeps once stepped, settings are numbers where
the live optimizer's are, the loss scale is finite and positive, each RNG state loads into a throwaway
generator. ``load_checkpoint`` also restores from a snapshot if anything still fails part way.

The checks mirror what each ``load_state_dict`` would refuse or, worse, silently accept: torch's
``Optimizer.load_state_dict`` takes an AdamW state into an SGD (and the next step dies with
``KeyError: 'momentum'``), and ``nn.Module.load_state_dict`` casts a tensor of another dtype in place.
"""

from __future__ import annotations

import inspect
import math
import random
from typing import Any

import numpy as np
import torch

from .values import (check_compact_moments, check_fp8_values, check_kahan_pairs,
                                check_moment_values, check_scale_limits)

__all__ = ["check_fits", "check_engine_state", "TOP_KEYS"]

TOP_KEYS = ("model", "optimizer", "mixprec", "scheduler", "rng", "extra")

# torch's optimizers whose per-parameter state tensors (momentum, moments) have the parameter's shape;
# others (Adafactor's factored moments, a user's own) may hold any shape, so only these are checked.
_ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                           "ASGD", "Rprop")


def check_fits(state: Any, engine: Any, scheduler: Any, *, ignore_scheduler: bool = False) -> None:
    """Raise ValueError if ``state`` (a loaded checkpoint) cannot be restored into ``engine`` whole."""
    if not isinstance(state, dict) or set(TOP_KEYS) - set(state):
        have = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"holds {have}, not a save_checkpoint payload (needs {', '.join(TOP_KEYS)})")
    _check_recipe(engine, state["mixprec"])           # the most common misfit, named first
    _check_tensors("model", state["model"], engine.model.state_dict(),
                   "build the model as it was when the checkpoint was saved")
    check_engine_state(engine, state["mixprec"])
    kahan = getattr(engine.master, "kahan", None)
    if kahan is not None:    # the compensations belong to the checkpoint's own weights
        key_of = {id(p): k for k, p in engine.model.state_dict(keep_vars=True).items()}
        check_kahan_pairs(kahan, state["mixprec"]["master"].get("compensation"),
                          [state["model"][key_of[id(p)]] for p in kahan.params])
    _check_optimizer(state, engine.optimizer, _shapes_by_param(engine))
    _check_scheduler(state, scheduler, ignore_scheduler)
    if state["rng"] is not None:
        _check_rng(state["rng"])


def check_engine_state(engine: Any, state: Any) -> None:
    """Raise ValueError if ``engine.load_state_dict(state)`` would fail part way or load a misfit."""
    _check_recipe(engine, state)
    own_scale = engine.loss_scale.state_dict()
    check_kind = getattr(engine.loss_scale, "check_state", None)    # a kind's own rules (loss_scale/per_layer.py)
    if check_kind is not None and isinstance(state.get("loss_scale"), dict):
        check_kind(state["loss_scale"])
    _check_tensors("loss scale", state.get("loss_scale"), own_scale,
                   "it was saved by a different kind of loss scale")
    _check_scale_values(state["loss_scale"], own_scale)
    check_scale_limits(engine.loss_scale, state["loss_scale"])     # inside [floor, ceiling], counts in range
    if engine.master is not None:
        _check_master(engine.master, state.get("master"))
    if engine.moments is not None:
        check_compact_moments(engine.moments, state.get("moments"))
    if engine.fp8_report is not None:
        from ..fp8.state import fp8_state_dict   # the fp8 package is loaded already when fp8 is on
        own = fp8_state_dict(engine.model)
        saved = state.get("fp8")
        if not isinstance(saved, dict) or set(saved) != set(own):
            names = sorted(saved) if isinstance(saved, dict) else "none"
            raise ValueError(f"fp8 state holds layers {names}, the model's fp8 layers are {sorted(own)}: "
                             "build the model and the fp8 recipe as they were when the state was saved")
        for name, layer_state in own.items():
            _check_tensors(f"fp8 layer {name!r}", saved[name], layer_state,
                           "was it saved under another fp8 recipe (history length, scaling)?")
            check_fp8_values(name, saved[name])


def _check_recipe(engine: Any, state: Any) -> None:
    if not isinstance(state, dict) or "recipe" not in state:
        what = (f"a dict without 'recipe' (keys {sorted(map(str, state))[:5]})" if isinstance(state, dict)
                else type(state).__name__)
        raise ValueError(f"the mixprec state is {what}, not what mp.state_dict() returns (recipe, "
                         "loss_scale, master, ...): was it written by mp.state_dict() or save_checkpoint?")
    if state["recipe"] != str(engine.recipe):
        raise ValueError(f"state was saved under recipe {state['recipe']!r} but this engine runs "
                         f"{str(engine.recipe)!r}: build MixedPrecision with the saved recipe to resume")


def _check_tensors(what: str, saved: Any, own: dict[str, torch.Tensor], fix: str) -> None:
    """Same keys, and for each key a tensor of the same shape and dtype."""
    if not isinstance(saved, dict):
        raise ValueError(f"{what} state is {type(saved).__name__}, not a dict of tensors: {fix}")
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    if missing or unexpected:
        raise ValueError(f"{what} state does not match: missing {_few(missing)}, unexpected "
                         f"{_few(unexpected)}: {fix}")
    for key, tensor in own.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what} state {key!r} is {type(value).__name__}, not a tensor: {fix}")
        if value.shape != tensor.shape:
            raise ValueError(f"{what} state {key!r} has shape {tuple(value.shape)}, this one needs "
                             f"{tuple(tensor.shape)}: {fix}")
        if value.dtype != tensor.dtype:
            # load_state_dict would cast it silently; a dtype change means another recipe or model.
            raise ValueError(f"{what} state {key!r} is {value.dtype}, this one is {tensor.dtype}: {fix}")


def _check_master(master: Any, saved: Any) -> None:
    if not isinstance(saved, dict):
        raise ValueError("the checkpoint holds no master-weight state but this recipe keeps one: was it "
                         "saved under another recipe?")
    if master.keep:
        masters = saved.get("masters")
        if not isinstance(masters, (list, tuple)) or len(masters) != len(master.masters):
            n = len(masters) if isinstance(masters, (list, tuple)) else 0
            raise ValueError(f"master state holds {n} tensors, this model has {len(master.masters)} "
                             "low-precision parameters: was it saved from a different model or recipe?")
        for i, (m, value) in enumerate(zip(master.masters, masters)):
            if not isinstance(value, torch.Tensor) or value.shape != m.shape or value.dtype != m.dtype:
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else "no tensor"
                raise ValueError(f"master weight {i} in the state is {got}, the model's is "
                                 f"{tuple(m.shape)} {m.dtype}: was it saved from a different model?")
    generator = saved.get("generator")
    if master.generator is not None and generator is not None:
        master.generator.check_state(generator)    # RoundingNoise's state: 3 int64, in range
    if master.kahan is not None:
        master.kahan.check_state(saved.get("compensation"))   # bf16-kahan: int16, one per weight, its shape


def _shapes_by_param(engine: Any) -> dict[int, torch.Size]:
    """Each optimizer parameter's true shape: a transient fp32 copy (bf16-sr) is empty between steps."""
    shapes = {id(p): p.shape for g in engine.optimizer.param_groups for p in g["params"]}
    if engine.master is not None:
        shapes |= {id(m): p.shape for p, m in zip(engine.master.model_params, engine.master.masters)}
    return shapes


def _check_optimizer(state: dict, optimizer: torch.optim.Optimizer, shapes: dict[int, torch.Size]) -> None:
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


def _check_scale_values(saved: dict, own: dict[str, torch.Tensor]) -> None:
    """The scale a finite positive number (a fixed scale the recipe's own value), the counters >= 0."""
    for key, mine in own.items():
        value = saved[key]
        if value.is_floating_point():
            low_ok = (value >= 0) if key == "layer_peak" else (value > 0)   # a peak is 0 until a layer runs
            if not (bool(torch.isfinite(value).all()) and bool(low_ok.all())):
                raise ValueError(f"loss scale state {key!r} is {value.tolist()}, not a finite positive "
                                 "number: was the file edited?")
        elif bool((value < 0).any()):
            raise ValueError(f"loss scale state {key!r} is {value.tolist()}, a negative count: was the file "
                             "edited?")
    if "clean_steps" not in own and not torch.equal(saved["value"].cpu(), own["value"].cpu()):
        raise ValueError(f"the loss scale is fixed at {own['value'].item():g} by the recipe, the checkpoint "
                         f"holds {saved['value'].item():g}: was the file edited?")
    if bool(saved["skipped"] > saved["steps"]):
        raise ValueError(f"the loss scale state counts {int(saved['skipped'])} skipped of "
                         f"{int(saved['steps'])} steps: was the file edited?")


def _check_scheduler(state: dict, scheduler: Any, ignore_scheduler: bool) -> None:
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


_PYTHON_RNG = random.getstate()[0], len(random.getstate()[1])    # (version 3, 625 words)


def _check_rng(rng: Any) -> None:
    """Each RNG state loads: tried on throwaway generators (torch, ``random.Random``, NumPy's RandomState)."""
    fix = "load with rng=False to skip it"
    if not (isinstance(rng, dict) and {"torch", "cuda", "python", "numpy"} <= set(rng)):
        raise ValueError(f"the RNG state is not the one save_checkpoint writes: {fix}")
    cpu = rng["torch"]
    own = torch.get_rng_state()
    if not (isinstance(cpu, torch.Tensor) and cpu.shape == own.shape and cpu.dtype == own.dtype):
        raise ValueError(f"the RNG state's torch part is {_describe(cpu)}, torch.get_rng_state() is "
                         f"{_describe(own)}: {fix}")
    try:
        torch.Generator().set_state(cpu.cpu())
    except Exception as exc:
        raise ValueError(f"the RNG state's torch part does not load ({exc}): {fix}") from None
    cuda = rng["cuda"]
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda)):
        raise ValueError(f"the RNG state's CUDA part is not a list of uint8 tensors: {fix}")
    if cuda is not None and torch.cuda.is_available() and len(cuda) > torch.cuda.device_count():
        raise ValueError(f"the RNG state holds {len(cuda)} CUDA generators, this machine has "
                         f"{torch.cuda.device_count()} GPUs: {fix}")
    python = rng["python"]
    try:
        version, keys, gauss = python
        if not (isinstance(version, int) and isinstance(keys, (list, tuple)) and len(keys) == _PYTHON_RNG[1]
                and all(type(k) is int for k in keys) and (gauss is None or isinstance(gauss, float))):
            raise ValueError("not (version, 625 ints, None or a float)")
        random.Random().setstate((version, tuple(keys), gauss))
    except Exception as exc:
        raise ValueError(f"the RNG state's Python part does not load ({exc}): {fix}") from None
    numpy = rng["numpy"]
    try:
        name, keys, pos, has_gauss, gauss = numpy
        if not (isinstance(keys, torch.Tensor) and keys.shape == (624,) and not keys.is_floating_point()
                and bool(((keys >= 0) & (keys < 2 ** 32)).all())):
            raise ValueError("its key is not 624 integers in [0, 2**32)")
        if not (isinstance(name, str) and type(pos) is int and type(has_gauss) is int
                and isinstance(gauss, float)):
            raise ValueError("not (name, key, int pos, int has_gauss, float gauss)")
        np.random.RandomState().set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    except Exception as exc:
        raise ValueError(f"the RNG state's NumPy part does not load ({exc}): {fix}") from None


def _few(names: list[str], n: int = 5) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")

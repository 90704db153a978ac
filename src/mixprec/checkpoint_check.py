"""Does a loaded checkpoint fit the engine it is about to be restored into? Checked before anything moves.

``load_checkpoint`` restores six things (model, engine state, optimizer, scheduler, RNG, extras). If it
found a mismatch halfway, the model would already hold the new weights while the optimizer or the
master copy still held the old ones: a half-restored run that trains on without a word. So every
check runs first, on the loaded data and the engine's own shapes, and raises ``ValueError`` with the
problem and the fix; nothing here writes to the engine, the optimizer, the scheduler or the RNG::

    check_fits(state, engine, scheduler)     # ValueError naming the first misfit, or None
    ... then restore, knowing each load_state_dict will accept what it is given

The checks mirror what each ``load_state_dict`` would refuse or, worse, silently accept: torch's
``Optimizer.load_state_dict`` takes an AdamW state into an SGD (and the next step dies with
``KeyError: 'momentum'``), and ``nn.Module.load_state_dict`` casts a tensor of another dtype in place.
"""

from __future__ import annotations

from typing import Any

import torch

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
    _check_optimizer(state, engine.optimizer, _shapes_by_param(engine))
    _check_scheduler(state, scheduler, ignore_scheduler)
    if state["rng"] is not None:
        _check_rng(state["rng"])


def check_engine_state(engine: Any, state: Any) -> None:
    """Raise ValueError if ``engine.load_state_dict(state)`` would fail part way or load a misfit."""
    _check_recipe(engine, state)
    own_scale = engine.loss_scale.state_dict()
    _check_tensors("loss scale", state.get("loss_scale"), own_scale,
                   "it was saved by a different kind of loss scale")
    if engine.master is not None:
        _check_master(engine.master, state.get("master"))
    if engine.fp8_report is not None:
        from .fp8.state import fp8_state_dict   # the fp8 package is loaded already when fp8 is on
        own = fp8_state_dict(engine.model)
        saved = state.get("fp8")
        if not isinstance(saved, dict) or set(saved) != set(own):
            names = sorted(saved) if isinstance(saved, dict) else "none"
            raise ValueError(f"fp8 state holds layers {names}, the model's fp8 layers are {sorted(own)}: "
                             "build the model and the fp8 recipe as they were when the state was saved")
        for name, layer_state in own.items():
            _check_tensors(f"fp8 layer {name!r}", saved[name], layer_state,
                           "was it saved under another fp8 recipe (history length, scaling)?")


def _check_recipe(engine: Any, state: Any) -> None:
    if not isinstance(state, dict) or "recipe" not in state:
        raise ValueError("the mixprec state is missing or not a dict: was the file written by "
                         "save_checkpoint?")
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
    if mine not in _ELEMENTWISE_OPTIMIZERS:
        return
    params = [shapes[id(p)] for g in own_groups for p in g["params"]]   # state_dict's numbering
    for index, entry in saved["state"].items():
        if not (isinstance(index, int) and 0 <= index < len(params)):
            raise ValueError(f"the optimizer state refers to parameter {index!r}; this optimizer holds "
                             f"{len(params)}")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index]:
                raise ValueError(f"optimizer state {key!r} of parameter {index} has shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(params[index])}: was "
                                 "it saved from a different model?")


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


def _check_rng(rng: Any) -> None:
    ok = (isinstance(rng, dict) and {"torch", "cuda", "python", "numpy"} <= set(rng)
          and isinstance(rng["torch"], torch.Tensor)
          and rng["torch"].shape == torch.get_rng_state().shape
          and isinstance(rng["python"], (list, tuple)) and len(rng["python"]) == 3
          and isinstance(rng["numpy"], (list, tuple)) and len(rng["numpy"]) == 5)
    if not ok:
        raise ValueError("the RNG state is not the one save_checkpoint writes: load with rng=False to "
                         "skip it")


def _few(names: list[str], n: int = 5) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")

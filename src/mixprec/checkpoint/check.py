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
generator. ``load_checkpoint`` also restores from a snapshot if anything still fails part way. This
module checks the model, the engine's own state and the RNG states; the optimizer and LR scheduler
are ``optim.py``'s, the values no run can produce ``values.py``'s.

The checks mirror what each ``load_state_dict`` would refuse or, worse, silently accept: torch's
``Optimizer.load_state_dict`` takes an AdamW state into an SGD (and the next step dies with
``KeyError: 'momentum'``), and ``nn.Module.load_state_dict`` casts a tensor of another dtype in place.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .optim import _describe, _few, check_optimizer, check_scheduler   # _describe, _few: shared wording
from .values import check_compact_moments, check_fp8_values, check_kahan_pairs, check_scale_limits

__all__ = ["check_fits", "check_engine_state", "TOP_KEYS"]

TOP_KEYS = ("model", "optimizer", "mixprec", "scheduler", "rng", "extra")


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
    check_optimizer(state, engine.optimizer, _shapes_by_param(engine))     # optim.py
    check_scheduler(state, scheduler, ignore_scheduler)
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

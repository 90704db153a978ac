"""The probe's checkpoint cases: wrong arguments to save/load/read, damaged files, and crafted payloads
(a valid file re-written with one field changed and a correct checksum). A refused load must change
nothing: model, fp32 copies, optimizer, loss scale, scheduler and the RNG states are compared bitwise,
and the engine must still train (see probe_bad_inputs.py for the outcome rules)."""

from __future__ import annotations

import atexit
import copy
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from mixprec import load_checkpoint, read_checkpoint, save_checkpoint
from mixprec.checkpoint.verified import read_verified, write_verified

from probe_bad_inputs import (CLEAR, Outcome, add, case, correct, engine, engine_state, refused, same, tiny, train)

_TMP = Path(tempfile.mkdtemp(prefix="mixprec-probe-ckpt-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
_COUNT = [0]


def fresh_path(name: str = "ck.pt") -> Path:
    _COUNT[0] += 1
    folder = _TMP / f"c{_COUNT[0]}"
    folder.mkdir()
    return folder / name


def trained(recipe: str = "fp16-pure", opt: str = "adamw", seed: int = 0):
    torch.manual_seed(seed)
    mp = engine(recipe, opt, model=tiny(seed))
    sched = torch.optim.lr_scheduler.LambdaLR(mp.optimizer, lambda s: 0.9 ** s)
    for i in range(2):
        train(mp, 1, seed=i + 1)
        sched.step()
    return mp, sched


def full_state(mp, sched) -> dict[str, Any]:
    return {**engine_state(mp), "sched": copy.deepcopy(sched.state_dict()) if sched is not None else None,
            "rng": (torch.get_rng_state(), random.getstate(), torch.from_numpy(np.random.get_state()[1].copy()))}


def still_trains(mp) -> bool:
    result = train(mp, 1, seed=9)
    return bool(torch.isfinite(torch.as_tensor(result.grad_norm)).all())


def refused_load(path: Path, *words: str, target=None, **kwargs) -> Outcome:
    """Load ``path`` into a freshly trained engine: must be refused naming ``words``, nothing changed,
    and the engine must train on."""
    mp, sched = target() if target is not None else trained(seed=5)
    kwargs.setdefault("scheduler", sched)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    outcome = refused(lambda: load_checkpoint(path, mp, **kwargs), *words, state=lambda: full_state(mp, sched))
    if outcome.kind == CLEAR and not still_trains(mp):
        return Outcome("partial change", "refused, but the engine no longer trains")
    return outcome


def crafted(edit: Callable[[dict], Any]) -> Path:
    mp, sched = trained(seed=3)
    path = fresh_path()
    save_checkpoint(path, mp, scheduler=sched, extra={"step": 2})
    state = read_verified(path, torch.device("cpu"))
    edit(state)
    write_verified(path, state)
    return path


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(state):
        target = state
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value(target[keys[-1]]) if callable(value) else value
    return edit


def _pop(*keys):
    def edit(state):
        target = state
        for k in keys[:-1]:
            target = target[k]
        del target[keys[-1]]
    return edit


# (what, edit of the payload, words the error must hold). Issue 24's crafted checkpoints and neighbours.
CRAFTED = [
    ("python RNG state malformed", _set("rng", "python", 1, [1, 2, 3]), ["Python"]),
    ("python RNG version a string", _set("rng", "python", 0, "three"), ["Python"]),
    ("numpy RNG keys cut short", _set("rng", "numpy", 1, lambda k: k[:5]), ["NumPy"]),
    ("numpy RNG position a string", _set("rng", "numpy", 2, "x"), ["NumPy"]),
    ("torch RNG state a list", _set("rng", "torch", [1, 2, 3]), ["torch"]),
    ("rng a list", _set("rng", [1, 2]), ["rng"]),
    ("scheduler state a list", _set("scheduler", [1, 2]), ["scheduler"]),
    ("scheduler last_epoch a string", _set("scheduler", "last_epoch", "two"), ["last_epoch"]),
    ("scheduler base_lrs missing", _pop("scheduler", "base_lrs"), ["base_lrs"]),
    ("scheduler_type of another class", _set("scheduler_type", "StepLR"), ["StepLR"]),
    ("optimizer step a string", _set("optimizer", "state", 0, "step", "3"), ["step"]),
    ("optimizer step negative", _set("optimizer", "state", 0, "step", torch.tensor(-2.0)), ["step"]),
    ("optimizer step nan", _set("optimizer", "state", 0, "step", torch.tensor(float("nan"))), ["step"]),
    ("optimizer exp_avg_sq missing", _pop("optimizer", "state", 1, "exp_avg_sq"), ["exp_avg_sq"]),
    ("optimizer exp_avg of the wrong shape", _set("optimizer", "state", 0, "exp_avg", torch.zeros(3)),
     ["exp_avg"]),
    ("optimizer lr a string", _set("optimizer", "param_groups", 0, "lr", "1e-3"), ["lr"]),
    ("optimizer lr negative", _set("optimizer", "param_groups", 0, "lr", -1.0), ["learning rate"]),
    ("optimizer eps nan", _set("optimizer", "param_groups", 0, "eps", float("nan")), ["eps"]),
    ("optimizer betas one number", _set("optimizer", "param_groups", 0, "betas", (0.9,)), ["betas"]),
    ("optimizer param_groups missing", _pop("optimizer", "param_groups"), ["Optimizer.state_dict"]),
    ("optimizer state a list", _set("optimizer", "state", []), ["state"]),
    ("optimizer state for parameter 99", _set("optimizer", "state", 99, {"step": torch.tensor(1.0)}), ["99"]),
    ("optimizer_type SGD", _set("optimizer_type", "SGD"), ["SGD"]),
    ("model weight of the wrong shape", _set("model", "0.weight", torch.zeros(3, 3, dtype=torch.float16)),
     ["0.weight"]),
    ("model weight float64", _set("model", "0.weight", lambda t: t.double()), ["float64"]),
    ("model weight a list", _set("model", "0.weight", [1.0, 2.0]), ["0.weight"]),
    ("model key missing", _pop("model", "3.bias"), ["3.bias"]),
    ("model an extra key", _set("model", "9.weight", torch.zeros(2)), ["9.weight"]),
    ("master copies: one missing", lambda s: s["mixprec"]["master"]["masters"].pop(), ["master"]),
    ("master copy float16", _set("mixprec", "master", "masters", 0, lambda t: t.half()), ["master"]),
    ("master a list", _set("mixprec", "master", [1, 2]), ["master"]),
    ("recipe another", _set("mixprec", "recipe", "bf16-pure"), ["recipe"]),
    ("recipe not a recipe", _set("mixprec", "recipe", "fp17"), ["fp17"]),
    ("loss scale value nan", _set("mixprec", "loss_scale", "value", torch.tensor(float("nan"))), ["value"]),
    ("loss scale value 0", _set("mixprec", "loss_scale", "value", torch.tensor(0.0)), ["value"]),
    ("loss scale value a float", _set("mixprec", "loss_scale", "value", 1024.0), ["value"]),
    ("loss scale steps negative", _set("mixprec", "loss_scale", "steps", lambda t: t.fill_(-1)), ["steps"]),
    ("loss scale key missing", _pop("mixprec", "loss_scale", "hysteresis_left"), ["hysteresis_left"]),
    ("loss scale a list", _set("mixprec", "loss_scale", [1]), ["loss scale"]),
    ("mixprec part missing", _pop("mixprec"), ["mixprec"]),
    ("extra part missing", _pop("extra"), ["extra"]),
    ("payload a list", lambda s: (s.clear(), s.update({"weights": torch.zeros(3)})), ["save_checkpoint"]),
]
for what, edit, words in CRAFTED:
    add("ckpt", f"crafted: {what}", lambda e=edit, w=words: refused_load(crafted(e), *w))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))


def _damaged(damage: Callable[[Path], Any]) -> Path:
    mp, sched = trained(seed=3)
    path = fresh_path()
    save_checkpoint(path, mp, scheduler=sched)
    damage(path)
    return path


DAMAGED = [
    ("a byte flipped", _flip_byte, ["checksum"]),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-64]), ["truncated"]),
    ("cut inside the header", lambda p: p.write_bytes(p.read_bytes()[:30]), ["truncated"]),
    ("empty file", lambda p: p.write_bytes(b""), ["header"]),
    ("a torch.save file", lambda p: torch.save({"model": {}}, p), ["not a mixprec checkpoint"]),
    ("a text file", lambda p: p.write_text("hello"), ["not a mixprec checkpoint"]),
]
for what, damage, words in DAMAGED:
    add("ckpt", f"load: {what}", lambda d=damage, w=words: refused_load(_damaged(d), *w))


def _other_engine(recipe="fp16-pure", opt="adamw"):
    def target():
        return trained(recipe, opt, seed=5)
    return target


MISFITS = [   # a valid file into an engine it does not fit
    ("into an SGD engine", _other_engine(opt="sgd"), ["AdamW", "SGD"]),
    ("into a bf16-pure engine", _other_engine("bf16-pure"), ["recipe"]),
    ("into an fp16 engine", _other_engine("fp16"), ["recipe"]),
]
for what, target, words in MISFITS:
    add("ckpt", f"load: {what}", lambda t=target, w=words: refused_load(_damaged(lambda p: None), *w, target=t))


@case("ckpt", "crafted: optimizer exp_avg float64 loads as fp32")
def _exp_avg_double() -> Outcome:
    # torch's Optimizer.load_state_dict casts floating state to its parameter's dtype: a float64 moment
    # of an fp32 parameter is that moment rounded to fp32, as torch itself loads it.
    path = crafted(_set("optimizer", "state", 0, "exp_avg", lambda t: t.double() + 1e-12))
    saved = read_verified(path, torch.device("cpu"))["optimizer"]["state"][0]["exp_avg"]
    mp, sched = trained(seed=5)
    load_checkpoint(path, mp, scheduler=sched)
    loaded = mp.optimizer.state_dict()["state"][0]["exp_avg"]
    return correct(loaded.dtype == torch.float32 and torch.equal(loaded, saved.float()) and still_trains(mp),
                   "the moment is loaded rounded to fp32, as torch loads it, and training goes on")


@case("ckpt", "load: file has a scheduler, none given")
def _no_sched() -> Outcome:
    return refused_load(_damaged(lambda p: None), "ignore_scheduler", scheduler=None)


@case("ckpt", "load: scheduler bound to another optimizer")
def _sched_other() -> Outcome:
    other = torch.optim.SGD(tiny().parameters(), lr=0.1)
    return refused_load(_damaged(lambda p: None), "another optimizer",
                        scheduler=torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0))


@case("ckpt", "load: scheduler=an optimizer")
def _sched_optimizer() -> Outcome:
    return refused_load(_damaged(lambda p: None), "optimizer",
                        scheduler=torch.optim.SGD(tiny().parameters(), lr=0.1))


# (what, call given (mp, sched, path of a good file, a fresh path), words)
ARGUMENTS = [
    ("save(scheduler=optimizer)", lambda mp, s, good, new: save_checkpoint(new, mp, scheduler=mp.optimizer),
     ["optimizer"]),
    ("save(scheduler=object())", lambda mp, s, good, new: save_checkpoint(new, mp, scheduler=object()),
     ["state_dict"]),
    ("save(scheduler of another optimizer)", lambda mp, s, good, new: save_checkpoint(
        new, mp, scheduler=torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), lambda e: 1.0)), ["another optimizer"]),
    ("save('run/') to a folder not yet there", lambda mp, s, good, new: save_checkpoint(
        str(new.parent / "run") + "/", mp), ["folder"]),
    ("save(an existing folder)", lambda mp, s, good, new: save_checkpoint(new.parent, mp), ["directory"]),
    ("save(a path through a file)", lambda mp, s, good, new: save_checkpoint(good / "x.ckpt", mp), ["file"]),
    ("save(None, mp)", lambda mp, s, good, new: save_checkpoint(None, mp), ["path"]),
    ("save(mp, path) swapped", lambda mp, s, good, new: save_checkpoint(mp, new), ["path first"]),
    ("save(path, model)", lambda mp, s, good, new: save_checkpoint(new, mp.model), ["engine"]),
    ("save(path, optimizer)", lambda mp, s, good, new: save_checkpoint(new, mp.optimizer), ["engine"]),
    ("save(extra=a lambda)", lambda mp, s, good, new: save_checkpoint(new, mp, extra={"f": lambda: 1}),
     ["pickle"]),
    ("save(extra=a generator)", lambda mp, s, good, new: save_checkpoint(new, mp, extra=(i for i in [1])),
     ["pickle"]),
    ("save(rng='no')", lambda mp, s, good, new: save_checkpoint(new, mp, rng="no"), ["rng"]),
    ("save(path=3)", lambda mp, s, good, new: save_checkpoint(3, mp), ["path"]),
    ("load(path, model)", lambda mp, s, good, new: load_checkpoint(good, mp.model), ["engine"]),
    ("load(mp, path) swapped", lambda mp, s, good, new: load_checkpoint(mp, good), ["path first"]),
    ("load(None, mp)", lambda mp, s, good, new: load_checkpoint(None, mp), ["path"]),
    ("load(a missing file)", lambda mp, s, good, new: load_checkpoint(new, mp, scheduler=s), ["no such"]),
    ("load(a folder)", lambda mp, s, good, new: load_checkpoint(new.parent, mp, scheduler=s), ["directory"]),
    ("load(rng='no')", lambda mp, s, good, new: load_checkpoint(good, mp, scheduler=s, rng="no"), ["rng"]),
    ("load(weights_only='no')", lambda mp, s, good, new: load_checkpoint(good, mp, scheduler=s,
                                                                        weights_only="no"), ["weights_only"]),
    ("load(ignore_scheduler='yes')", lambda mp, s, good, new: load_checkpoint(good, mp, ignore_scheduler="yes"),
     ["ignore_scheduler"]),
    ("load(scheduler=object())", lambda mp, s, good, new: load_checkpoint(good, mp, scheduler=object()),
     ["state_dict"]),
]


def _argument_case(call, words) -> Outcome:
    mp, sched = trained(seed=5)
    good = fresh_path()
    save_checkpoint(good, mp, scheduler=sched)
    new = fresh_path("new.ckpt")
    outcome = refused(lambda: call(mp, sched, good, new), *words, state=lambda: full_state(mp, sched))
    written = [p for p in new.parent.rglob("*") if p.is_file()]
    if outcome.kind == CLEAR and written:
        return Outcome("partial change", f"refused, but wrote {written}")
    return outcome


for what, call, words in ARGUMENTS:
    add("ckpt", what, lambda c=call, w=words: _argument_case(c, w))


@case("ckpt", "torch.load on a checkpoint says how to open it")
def _torch_load() -> Outcome:
    path = _damaged(lambda p: None)
    return refused(lambda: torch.load(path), "read_checkpoint")


@case("ckpt", "torch.load(weights_only=False) says how to open it")
def _torch_load_unsafe() -> Outcome:
    path = _damaged(lambda p: None)
    return refused(lambda: torch.load(path, weights_only=False), "read_checkpoint")


READS = [
    ("read_checkpoint(None)", lambda good: read_checkpoint(None), ["path"]),
    ("read_checkpoint(a missing file)", lambda good: read_checkpoint(good.parent / "nope.ckpt"), ["no such"]),
    ("read_checkpoint(a folder)", lambda good: read_checkpoint(good.parent), ["directory"]),
    ("read_checkpoint(a torch.save file)", lambda good: (torch.save({}, good), read_checkpoint(good)),
     ["not a mixprec checkpoint"]),
    ("read_checkpoint(payload a list)", lambda good: (write_verified(good, [1, 2]), read_checkpoint(good)),
     ["save_checkpoint"]),
    ("read_checkpoint(mixprec part a list)", lambda good: (_rewrite(good, _set("mixprec", [1])),
                                                           read_checkpoint(good)), ["mixprec"]),
    ("read_checkpoint(loss scale a list)", lambda good: (_rewrite(good, _set("mixprec", "loss_scale", [1])),
                                                         read_checkpoint(good)), ["loss"]),
    ("read_checkpoint(weights_only='no')", lambda good: read_checkpoint(good, weights_only="no"), ["weights_only"]),
]


def _rewrite(path: Path, edit) -> None:
    state = read_verified(path, torch.device("cpu"))
    edit(state)
    write_verified(path, state)


for what, call, words in READS:
    def _read(c=call, w=words) -> Outcome:
        good = _damaged(lambda p: None)
        return refused(lambda: c(good), *w)
    add("ckpt", what, _read)


@case("ckpt", "read_checkpoint(loss scale steps a vector) shows no step count")
def _read_vector_steps() -> Outcome:
    good = _damaged(lambda p: None)
    _rewrite(good, _set("mixprec", "loss_scale", "steps", torch.zeros(3)))
    info = read_checkpoint(good)
    return correct(info.steps is None and "steps" in info.summary(),
                   "a crafted count that is not one number is left out of the summary; the rest shows")


@case("ckpt", "read_checkpoint of a good file")
def _read_good() -> Outcome:
    mp, sched = trained(seed=3)
    path = fresh_path()
    save_checkpoint(path, mp, scheduler=sched)
    info = read_checkpoint(path)
    return correct(info.recipe == str(mp.recipe) and info.steps == 2 and info.scheduler_type == "LambdaLR",
                   "recipe, steps and scheduler as saved")


@case("ckpt", "save, load, resume bit for bit")
def _round_trip() -> Outcome:
    mp, sched = trained(seed=3)
    path = fresh_path()
    save_checkpoint(path, mp, scheduler=sched)
    twin, twin_sched = trained(seed=8)
    load_checkpoint(path, twin, scheduler=twin_sched)
    train(mp, 1, seed=4), train(twin, 1, seed=4)
    return correct(same(engine_state(mp), engine_state(twin)), "the resumed engine steps as the original")

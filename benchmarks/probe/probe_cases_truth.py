"""The probe's issue-33 cases: the user's state is the truth. A weight changed after the engine was
built (load, in-place edit, re-init, EMA swap, a write through .data), a model cast that leaves the
first weight alone, an empty batch under every fp8 recipe, checkpoint values no run can produce, a
skipped fp8 step, and a binding clip against torch's own loop (see probe_bad_inputs.py for the
outcome rules)."""

from __future__ import annotations

import atexit
import copy
import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, load_checkpoint, save_checkpoint
from mixprec.checkpoint.verified import read_verified, write_verified

from probe_bad_inputs import (CLEAR, Outcome, add, batch, correct, engine, engine_state, refused, same, tiny,
                              train)

_TMP = Path(tempfile.mkdtemp(prefix="mixprec-probe-truth-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
_COUNT = [0]
PURE = ("fp16-pure", "bf16-pure", "bf16-kahan")
FP8 = ("fp8", "fp8-delayed", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4")


def _fp32_values(mp) -> list[torch.Tensor]:
    if mp.master.kahan is not None:
        return mp.master.kahan.fp32_weights()
    return [m.detach() for m in mp.master.masters]


def _lr0(recipe: str):
    model = tiny(0)
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)


# ------------------------------------------------------------------- class 1: a change is the truth
def _change(how: str, model: nn.Module) -> torch.Tensor:
    w = model[0].weight
    new = torch.randn(w.shape, generator=torch.Generator().manual_seed(5)).to(w.dtype)
    with torch.no_grad():
        if how == "load_state_dict":
            sd = model.state_dict()
            sd["0.weight"] = new
            model.load_state_dict(sd)
        elif how == "copy_ under no_grad":
            w.copy_(new)
        elif how == "reset_parameters":
            torch.manual_seed(11)
            model[0].reset_parameters()
            new = w.detach().clone()
        elif how == "EMA weights swapped in":
            w.copy_(w * 0.5 + new * 0.5)
            new = w.detach().clone()
        elif how == "zero_":
            w.zero_()
            new = torch.zeros_like(w)
        elif how == "mul_(0)":
            w.mul_(0.0)
            new = w.detach().clone()
    return new


def _taken(recipe: str, how: str) -> Outcome:
    mp = _lr0(recipe)
    train(mp)
    new = _change(how, mp.model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train(mp, seed=3)
    w = mp.model[0].weight
    noted = any("changed since the engine last wrote" in str(r.message) for r in record)
    return correct(torch.equal(w.detach(), new) and torch.equal(_fp32_values(mp)[0], new.float()) and noted,
                   f"{how}: the weight and its fp32 value are the user's after the step, with a note")


for _r in PURE:
    for _how in ("load_state_dict", "copy_ under no_grad", "reset_parameters", "EMA weights swapped in",
                 "zero_", "mul_(0)"):
        add("truth", f"{_r}: {_how} after the engine", lambda r=_r, h=_how: _taken(r, h))


def _load_fp32(recipe: str) -> Outcome:
    source = tiny(3)
    with torch.no_grad():
        source[0].weight.add_(1e-4)
    sd = source.state_dict()
    mp = _lr0(recipe)
    mp.load_model_state_dict(sd)
    train(mp, seed=2)
    out = mp.fp32_state_dict()
    return correct(all(torch.equal(out[k], v) for k, v in sd.items()),
                   "load_model_state_dict: the fp32 weights come back bit for bit after a step at lr 0")


for _r in PURE + ("fp16", "bf16"):
    add("truth", f"{_r}: load_model_state_dict of fp32 weights", lambda r=_r: _load_fp32(r))


def _bf16_sr_load() -> Outcome:
    sd = tiny(3).state_dict()
    mp = _lr0("bf16-sr")
    mp.load_model_state_dict(sd)
    return correct(torch.equal(mp.model[0].weight.detach(), sd["0.weight"].bfloat16()),
                   "bf16-sr keeps no fp32 copy: the bf16 weight is the rounding of the loaded value")


add("truth", "bf16-sr: load_model_state_dict", _bf16_sr_load)


def _swap_back(recipe: str) -> Outcome:
    mp = engine(recipe)
    train(mp, 3)
    before = [m.detach().clone() for m in mp.master.masters]
    saved = [p.detach().clone() for p in mp.master.model_params]
    with torch.no_grad():
        for p in mp.master.model_params:
            p.mul_(0.5)
        for p, s_ in zip(mp.master.model_params, saved):
            p.copy_(s_)
    return correct(same(before, mp.state_dict()["master"]["masters"]),
                   "EMA weights swapped in and out: the masters keep their fp32 bits")


for _r in ("fp16-pure", "bf16-pure"):
    add("truth", f"{_r}: EMA swap in and back out", lambda r=_r: _swap_back(r))


def _data_zero_kahan() -> Outcome:
    mp = engine("bf16-kahan")
    train(mp, 2)
    mp.model[0].weight.data.zero_()          # no version counter moves: unseen, but never a NaN
    train(mp, 1, seed=4)
    return correct(all(torch.isfinite(v).all() for v in _fp32_values(mp))
                   and all(torch.isfinite(p).all() for p in mp.model.parameters()),
                   "bf16-kahan: weight.data.zero_() joins into +0.0, never a NaN")


add("truth", "bf16-kahan: weight.data.zero_() (bypasses the version counter)", _data_zero_kahan)


def _noted_once(recipe: str) -> Outcome:
    mp = _lr0(recipe)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(3):
            _change("copy_ under no_grad", mp.model)
            with torch.no_grad():
                mp.model[0].weight.mul_(1 + i)
            train(mp, seed=i + 1)
    notes = sum("changed since the engine last wrote" in str(r.message) for r in record)
    return correct(notes == 1, f"three changes, one note (got {notes})")


for _r in PURE:
    add("truth", f"{_r}: the note is said once", lambda r=_r: _noted_once(r))


def _untouched(recipe: str) -> Outcome:
    mp = engine(recipe)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train(mp, 3)
    return correct(not any("changed since" in str(r.message) for r in record),
                   "a loop that changes nothing itself gets no note")


for _r in PURE + ("bf16-sr",):
    add("truth", f"{_r}: an ordinary loop gets no note", lambda r=_r: _untouched(r))


# ------------------------------------------------------------------- class 2: dtype guards
def _cast_refused(recipe: str, cast: str) -> Outcome:
    mp = engine(recipe)
    train(mp)
    before = engine_state(mp)
    getattr(mp.model, cast)()

    def forward():
        with mp.autocast():
            mp.model(batch()[0])
    out = refused(forward, "changed dtype", "model.half()")
    if out.kind == CLEAR:
        after = engine_state(mp)
        # The refusal changed nothing of the engine's; the cast itself is the user's own doing.
        if not same(before["optimizer"], after["optimizer"]):
            return Outcome("partial change", "the optimizer state moved")
    return out


for _r in ("fp16-pure", "bf16-pure", "bf16-sr", "bf16-kahan", "fp16", "bf16"):
    for _c in ("half", "bfloat16", "double"):
        if (_r, _c) in (("bf16", "float"),):
            continue
        add("dtype", f"{_r}: model.{_c}() after the engine", lambda r=_r, c=_c: _cast_refused(r, c))


# ------------------------------------------------------------------- class 3: empty batches under fp8
def _fp8_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _empty_batch(recipe: str, opt: str) -> Outcome:
    mp = engine(recipe, opt, model=_fp8_model())
    train(mp)
    fp8_before = copy.deepcopy(mp.state_dict()["fp8"])
    with mp.autocast():
        loss = F.cross_entropy(mp.model(torch.zeros(0, 8)), torch.zeros(0, dtype=torch.long), reduction="sum")
    mp.backward(loss)
    zero = all(p.grad is None or not p.grad.any() for p in mp.model.parameters())
    result = mp.step()
    mp.zero_grad()
    ok = zero and not bool(result.skipped) and same(fp8_before, mp.state_dict()["fp8"]) and bool(fp8_before)
    train(mp, seed=5)
    return correct(ok and all(torch.isfinite(p).all() for p in mp.model.parameters()),
                   "0 rows: zero gradients, the step taken, the fp8 state as it was, training goes on")


for _r in FP8:
    for _o in ("adamw", "sgd-momentum"):
        add("empty", f"{_r} ({_o}): a batch of 0 rows", lambda r=_r, o=_o: _empty_batch(r, o))


# ------------------------------------------------------------------- class 5: checkpoint values
def _path() -> Path:
    _COUNT[0] += 1
    folder = _TMP / f"c{_COUNT[0]}"
    folder.mkdir()
    return folder / "ck.pt"


_OPTS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-3),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}


def _trained(recipe: str, opt: str, seed: int, fp8: bool):
    model = _fp8_model() if fp8 else tiny(0)
    mp = MixedPrecision(model, _OPTS[opt](model.parameters()), recipe)
    train(mp, 2, seed=seed)
    return mp


def _value_refused(recipe: str, opt: str, edit: Callable[[dict], Any], words: tuple[str, ...],
                   fp8: bool = False) -> Outcome:
    path = _path()
    save_checkpoint(path, _trained(recipe, opt, 1, fp8))
    state = read_verified(path, torch.device("cpu"))
    edit(state)
    write_verified(path, state)
    mp = _trained(recipe, opt, 4, fp8)
    out = refused(lambda: load_checkpoint(path, mp), *words, state=lambda: engine_state(mp))
    if out.kind == CLEAR:
        train(mp, seed=9)
    return out


def _opt_value(index: int, key: str, value: float):
    def edit(state):
        state["optimizer"]["state"][index][key].view(-1)[0] = value
    return edit


def _scale_value(key: str, value: float):
    def edit(state):
        state["mixprec"]["loss_scale"][key].fill_(value)
    return edit


def _compact_value(key: str, value: float):
    def edit(state):
        m = state["mixprec"]["moments"]["state"][0][key]
        (m[0] if isinstance(m, tuple) else m).view(-1)[0] = value
    return edit


def _fp8_value(key: str, value: float):
    def edit(state):
        next(iter(state["mixprec"]["fp8"].values()))[key].view(-1)[0] = value
    return edit


def _kahan_pair(weight: float, comp: int):
    def edit(state):
        state["model"]["0.weight"].view(-1)[0] = weight
        state["mixprec"]["master"]["compensation"][0].view(-1)[0] = comp
    return edit


VALUES: list[tuple[str, str, str, Callable, tuple[str, ...], bool]] = []
for _i in range(4):
    VALUES.append((f"AdamW exp_avg_sq of parameter {_i} negative", "fp16-pure", "adamw",
                   _opt_value(_i, "exp_avg_sq", -1e-4), (f"parameter {_i}", "negative"), False))
for _key, _v in (("exp_avg", math.nan), ("exp_avg", math.inf), ("exp_avg_sq", math.inf), ("exp_avg_sq", math.nan)):
    VALUES.append((f"AdamW {_key} {_v}", "bf16", "adamw", _opt_value(0, _key, _v), (_key, "non-finite"), False))
VALUES += [
    ("Adam(amsgrad) max_exp_avg_sq negative", "bf16", "adam-amsgrad", _opt_value(0, "max_exp_avg_sq", -1.0),
     ("max_exp_avg_sq", "negative"), False),
    ("Adagrad sum negative", "bf16", "adagrad", _opt_value(0, "sum", -1.0), ("'sum'", "negative"), False),
    ("Adagrad sum nan", "fp16", "adagrad", _opt_value(1, "sum", math.nan), ("'sum'", "non-finite"), False),
    ("RMSprop square_avg negative", "bf16", "rmsprop", _opt_value(0, "square_avg", -1.0), ("square_avg",), False),
    ("Adamax exp_inf negative", "bf16", "adamax", _opt_value(0, "exp_inf", -1.0), ("exp_inf",), False),
    ("SGD momentum_buffer inf", "fp16", "sgd-momentum", _opt_value(0, "momentum_buffer", math.inf),
     ("momentum_buffer", "non-finite"), False),
    ("loss scale above the ceiling", "fp16", "adamw", _scale_value("value", 2.0**25), ("[floor, ceiling]",), False),
    ("loss scale below the floor", "fp16", "adamw", _scale_value("value", 0.25), ("floor",), False),
    ("loss scale below a floor of 64", "fp16,scale=dynamic(floor=64)", "adamw", _scale_value("value", 32.0),
     ("[64,",), False),
    ("loss scale above a ceiling of 2**10", "fp16-pure,scale=dynamic(init=512,ceiling=1024)", "adamw",
     _scale_value("value", 2048.0), ("1024",), False),
    ("clean_steps at growth_interval", "fp16", "adamw", _scale_value("clean_steps", 2000), ("clean_steps",), False),
    ("clean_steps past growth_interval", "fp16-pure", "adamw", _scale_value("clean_steps", 99999),
     ("clean_steps", "growth_interval"), False),
    ("clean_steps past growth_interval=10", "fp16,scale=dynamic(growth_interval=10)", "adamw",
     _scale_value("clean_steps", 10), ("growth_interval 10",), False),
    ("hysteresis_left above hysteresis", "fp16,scale=dynamic(hysteresis=2)", "adamw",
     _scale_value("hysteresis_left", 7), ("hysteresis_left",), False),
    ("per-layer scale above the ceiling", "fp16,scale=per-layer", "adamw", _scale_value("value", 2.0**26),
     ("ceiling",), False),
]
for _fmt in ("bf16", "bf16-sr"):
    for _key, _v, _w in (("exp_avg_sq", -1.0, "negative"), ("exp_avg", math.nan, "non-finite"),
                         ("exp_avg_sq", math.inf, "non-finite")):
        VALUES.append((f"moments={_fmt} {_key} {_v}", f"bf16-pure,moments={_fmt}", "adamw",
                       _compact_value(_key, _v), ("compact moment", _key, _w), False))
VALUES += [
    ("moments=fp8 exp_avg_sq a negative code", "bf16-pure,moments=fp8", "adamw", _compact_value("exp_avg_sq", 0xB8),
     ("compact moment", "negative"), False),
    ("moments=fp8 exp_avg a NaN code", "bf16-pure,moments=fp8", "adamw", _compact_value("exp_avg", 0x7F),
     ("compact moment", "non-finite"), False),
    ("bf16-kahan: zero weight, negative compensation", "bf16-kahan", "adamw", _kahan_pair(0.0, -3),
     ("Kahan compensation 0",), False),
    ("bf16-kahan: -0 weight, compensation -32768", "bf16-kahan", "adamw", _kahan_pair(-0.0, -32768),
     ("Kahan compensation 0",), False),
    ("bf16-kahan: inf weight, positive compensation", "bf16-kahan", "adamw", _kahan_pair(math.inf, 5),
     ("Kahan compensation 0",), False),
    ("bf16-kahan: NaN weight, a compensation", "bf16-kahan", "adamw", _kahan_pair(math.nan, 9),
     ("Kahan compensation 0",), False),
]
for _v in (0.5, 0.0, 2.0, -3.0, math.nan):
    VALUES.append((f"nvfp4 Hadamard sign {_v}", "nvfp4", "adamw", _fp8_value("rht_signs", _v),
                   ("rht_signs", "+1 and -1"), True))
VALUES += [
    ("fp8 input_scale inf", "fp8", "adamw", _fp8_value("input_scale", math.inf), ("input_scale",), True),
    ("fp8 weight_scale 0", "fp8", "adamw", _fp8_value("weight_scale", 0.0), ("weight_scale",), True),
    ("fp8-delayed history NaN", "fp8-delayed", "adamw", _fp8_value("input_history", math.nan),
     ("input_history", "non-finite"), True),
    ("fp8-delayed history negative", "fp8-delayed", "adamw", _fp8_value("weight_history", -1.0),
     ("weight_history", "negative"), True),
    ("fp8-delayed grad_output_scale -1", "fp8-delayed", "adamw", _fp8_value("grad_output_scale", -1.0),
     ("grad_output_scale",), True),
    ("mxfp8 amax negative", "mxfp8", "adamw", _fp8_value("input_amax", -1.0), ("input_amax",), True),
]
for _what, _r, _o, _e, _w, _f in VALUES:
    add("values", f"ckpt: {_what}", lambda r=_r, o=_o, e=_e, w=_w, f=_f: _value_refused(r, o, e, w, f))


def _loads(recipe: str, opt: str, fp8: bool) -> Outcome:
    mp = _trained(recipe, opt, 1, fp8)
    path = _path()
    save_checkpoint(path, mp)
    other = _trained(recipe, opt, 4, fp8)
    load_checkpoint(path, other)
    return correct(same(mp.state_dict(), other.state_dict()), "what a run writes loads, bit for bit")


for _r, _o, _f in (("fp16-pure", "adamw", False), ("bf16", "adagrad", False), ("bf16", "rmsprop", False),
                   ("bf16-kahan", "adamw", False), ("bf16-pure,moments=fp8", "adamw", False),
                   ("nvfp4", "adamw", True), ("fp8-delayed", "adamw", True)):
    add("values", f"ckpt: a {_r} ({_o}) run's own checkpoint loads", lambda r=_r, o=_o, f=_f: _loads(r, o, f))


# ------------------------------------------------------------------- class 6: a skipped fp8 step
def _bad_step(recipe: str) -> Outcome:
    mp = engine(recipe, model=_fp8_model())
    train(mp)
    x, y = batch(7)
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y) * math.inf
    mp.backward(loss)
    skipped = bool(mp.step().skipped)
    mp.zero_grad()
    scales_ok = all(torch.isfinite(v).all() and (v >= 0).all() for s in mp.state_dict()["fp8"].values()
                    for k, v in s.items() if k.endswith(("_scale", "_history")))
    path = _path()
    save_checkpoint(path, mp)
    load_checkpoint(path, mp)
    train(mp, 2, seed=8)
    return correct(skipped and scales_ok and all(torch.isfinite(p).all() for p in mp.model.parameters()),
                   "a bad step is skipped, its inf/NaN amax makes no scale, its checkpoint loads, training goes on")


for _r in FP8:
    add("skips", f"{_r}: a skipped step's amax poisons no scale", lambda r=_r: _bad_step(r))


# ------------------------------------------------------------------- class 7: a binding clip
def _clip_parity(recipe: str, opt: str) -> Outcome:
    dtype = torch.float16 if recipe == "fp16" else torch.bfloat16
    clip = 0.05
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
            "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
            "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[opt]
    ref = tiny(0)
    ref_opt = make(ref.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=recipe == "fp16")
    model = tiny(0)
    mp = MixedPrecision(model, make(model.parameters()), recipe, clip_grad_norm=clip)
    bound = True
    for i in range(3):
        x, y = batch(i + 1)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(ref(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        bound &= float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)) > clip
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        train(mp, 1, seed=i + 1)
    return correct(bound and all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters())),
                   "with the clip binding, the weights equal torch's unscale_/clip_grad_norm_/step loop")


for _r in ("fp16", "bf16"):
    for _o in ("adamw", "adamw-fused", "sgd-momentum"):
        add("clip", f"{_r} ({_o}): a binding clip like torch's loop", lambda r=_r, o=_o: _clip_parity(r, o))

"""A failed load_checkpoint changes nothing; checkpoint I/O errors name the user's path and the fix.

The matrix: (recipe, model keys, shapes, dtypes, optimizer type, param groups, scheduler both ways,
loss-scale/master/RNG state, truncated, not a payload) x (model, masters, optimizer, loss scale,
scheduler and RNG compared bitwise before and after the refused load).
"""

import errno
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.checkpoint.files
import mixprec.checkpoint.verified
from mixprec import CheckpointError, MixedPrecision, load_checkpoint, save_checkpoint
from mixprec.checkpoint.verified import read_verified, write_verified

from conftest import batches, tiny_model


def make(recipe="fp16-pure", opt="adamw", hidden=16, groups=1, seed=0, sched="lambda"):
    model = tiny_model(seed, hidden=hidden)
    params = list(model.parameters())
    pgroups = [{"params": params}] if groups == 1 else [{"params": params[:2]}, {"params": params[2:]}]
    optimizer = (torch.optim.AdamW(pgroups, lr=1e-3) if opt == "adamw"
                 else torch.optim.SGD(pgroups, lr=0.1, momentum=0.9))
    mp = MixedPrecision(model, optimizer, recipe)
    scheduler = {"lambda": lambda: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s),
                 "step": lambda: torch.optim.lr_scheduler.StepLR(optimizer, 2),
                 None: lambda: None}[sched]()
    for x, y in batches(2, seed=seed + 1, d_in=8):
        with mp.autocast():
            loss = F.cross_entropy(mp.model(x), y)
        mp.backward(loss)
        mp.step()
        if scheduler is not None:
            scheduler.step()
        mp.zero_grad()
    return mp, scheduler


def assert_still_trains(mp):
    """One more step after a refused or undone load: the engine trains on, finite."""
    x, y = batches(1, seed=9)[0]
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y)
    mp.backward(loss)
    assert torch.isfinite(torch.tensor(mp.step().grad_norm))


def snapshot(mp, scheduler):
    """Every piece of state a load could touch, cloned: compared bitwise after a refused load."""
    opt = mp.optimizer.state_dict()
    return {
        "model": [t.clone() for t in mp.model.state_dict().values()],
        "masters": [m.detach().clone() for m in mp.master.masters] if mp.master else [],
        "opt_state": [(i, k, v.clone()) for i, s in opt["state"].items() for k, v in s.items()],
        "opt_groups": [{k: v for k, v in g.items()} for g in opt["param_groups"]],
        "scale": {k: v.clone() for k, v in mp.loss_scale.state_dict().items()},
        "sched": dict(scheduler.state_dict()) if scheduler is not None else None,
        "rng": (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy()),
    }


def assert_same(a, b):
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a["model"], b["model"]))
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
    assert len(a["opt_state"]) == len(b["opt_state"])
    assert all(i == j and k == l and torch.equal(x, y)
               for (i, k, x), (j, l, y) in zip(a["opt_state"], b["opt_state"]))
    assert a["opt_groups"] == b["opt_groups"] and a["sched"] == b["sched"]
    assert all(torch.equal(a["scale"][k], b["scale"][k]) for k in a["scale"])
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]
    assert np.array_equal(a["rng"][2], b["rng"][2])


def surgery(edit):
    """A checkpoint of the reference run with ``edit(state)`` applied: a file that passes the checksum."""
    def write(path):
        saved()(path)
        state = read_verified(path, torch.device("cpu"))
        edit(state)
        write_verified(path, state)
    return write


def saved(**kwargs):
    def write(path):
        mp, sched = make(seed=3, **kwargs)
        save_checkpoint(path, mp, scheduler=sched)
    return write


def _drop_master(s):
    s["mixprec"]["master"]["masters"].pop()


def _to_double(s):
    s["model"]["0.weight"] = s["model"]["0.weight"].double()


def _drop_scale_key(s):
    del s["mixprec"]["loss_scale"]["hysteresis_left"]


def _bad_rng(s):
    s["rng"]["torch"] = s["rng"]["torch"][:10]


def _old_file_adam_into_sgd(s):   # a file written before the optimizer type was recorded
    del s["optimizer_type"]


def _not_payload(s):
    s.clear()
    s["weights"] = torch.zeros(3)


# (how the file is made, what the target engine is, words the error must hold)
MATRIX = {
    "recipe": (saved(recipe="params=fp16,compute=fp16,master=fp32,scale=static:1024"), {},
               ["saved under recipe", "static:1024"]),
    "recipe-dtype": (saved(recipe="bf16-pure"), {}, ["saved under recipe", "bf16"]),
    "missing-layer": (saved(), {"hidden": 16, "wrap": True}, ["missing", "unexpected"]),
    "shape": (saved(hidden=17), {}, ["shape (17, 8)", "(16, 8)"]),
    "dtype": (surgery(_to_double), {}, ["torch.float64", "torch.float16"]),
    "adamw-into-sgd": (saved(), {"opt": "sgd"}, ["AdamW", "SGD"]),
    "sgd-into-adamw": (saved(opt="sgd"), {}, ["SGD", "AdamW"]),
    "old-file-optimizer": (saved(), {"opt": "sgd", "drop_type": True}, ["momentum", "betas"]),
    "param-groups": (saved(groups=2), {}, ["2 param groups", "has 1"]),
    "scheduler-missing": (saved(), {"sched": None}, ["LambdaLR", "ignore_scheduler=True"]),
    "scheduler-unexpected": (saved(sched=None), {}, ["no LR scheduler state"]),
    "scheduler-type": (saved(sched="step"), {}, ["StepLR", "LambdaLR"]),
    "masters": (surgery(_drop_master), {}, ["master state holds 3 tensors", "4"]),
    "loss-scale": (surgery(_drop_scale_key), {}, ["loss scale", "hysteresis_left"]),
    "rng": (surgery(_bad_rng), {}, ["RNG state", "rng=False"]),
    "not-a-payload": (surgery(_not_payload), {}, ["not a save_checkpoint payload"]),
    # Issue 24: each of these used to overwrite model and optimizer, then fail (or crash the next step).
    "python-rng": (surgery(lambda s: s["rng"]["python"].__setitem__(1, [1, 2, 3])), {},
                   ["Python part", "rng=False"]),
    "python-rng-gauss": (surgery(lambda s: s["rng"]["python"].__setitem__(2, "x")), {}, ["Python part"]),
    "numpy-rng": (surgery(lambda s: s["rng"]["numpy"].__setitem__(1, s["rng"]["numpy"][1][:5])), {},
                  ["NumPy part", "rng=False"]),
    "numpy-rng-name": (surgery(lambda s: s["rng"]["numpy"].__setitem__(0, "PCG64")), {}, ["NumPy part"]),
    "numpy-rng-range": (surgery(lambda s: s["rng"]["numpy"][1].__setitem__(0, -1)), {}, ["NumPy part"]),
    "torch-rng-values": (surgery(lambda s: s["rng"]["torch"].__setitem__(slice(None), 0)), {},
                         ["torch part"]),
    "scheduler-list": (surgery(lambda s: s.__setitem__("scheduler", [1, 2])), {},
                       ["scheduler state is a list"]),
    "scheduler-value": (surgery(lambda s: s["scheduler"].__setitem__("last_epoch", "two")), {},
                        ["'last_epoch'", "not a finite number"]),
    "scheduler-keys": (surgery(lambda s: s["scheduler"].pop("base_lrs")), {}, ["LambdaLR state holds"]),
    "optimizer-step-string": (surgery(lambda s: s["optimizer"]["state"][0].__setitem__("step", "3")), {},
                              ["'step' of parameter 0", "not a finite scalar"]),
    "optimizer-step-negative": (surgery(lambda s: s["optimizer"]["state"][0].__setitem__(
        "step", torch.tensor(-2.0))), {}, ["negative step"]),
    "optimizer-missing-exp-avg-sq": (surgery(lambda s: s["optimizer"]["state"][1].pop("exp_avg_sq")), {},
                                     ["parameter 1", "missing exp_avg_sq"]),
    "optimizer-scalar-moment": (surgery(lambda s: s["optimizer"]["state"][0].__setitem__(
        "exp_avg", torch.tensor(0.5))), {}, ["'exp_avg' of parameter 0", "shape ()"]),
    "optimizer-lr-string": (surgery(lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", "1e-3")),
                            {}, ["'lr'", "not a finite number"]),
    "optimizer-betas": (surgery(lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", (0.9,))),
                        {}, ["'betas'", "not 2 finite numbers"]),
    "optimizer-beta-range": (surgery(lambda s: s["optimizer"]["param_groups"][0].__setitem__(
        "betas", (0.9, 1.5))), {}, ["refused by AdamW", "beta"]),
    "optimizer-params-numbering": (surgery(lambda s: s["optimizer"]["param_groups"][0].__setitem__(
        "params", s["optimizer"]["param_groups"][0]["params"][::-1])), {}, ["number their parameters"]),
    "optimizer-state-list": (surgery(lambda s: s["optimizer"].__setitem__("state", [])), {},
                             ["per-parameter state is a list"]),
    "scale-nan": (surgery(lambda s: s["mixprec"]["loss_scale"]["value"].fill_(float("nan"))), {},
                  ["'value'", "finite positive"]),
    "scale-negative-count": (surgery(lambda s: s["mixprec"]["loss_scale"]["steps"].fill_(-1)), {},
                             ["'steps'", "negative count"]),
    "truncated": (lambda p: (saved()(p), p.write_bytes(p.read_bytes()[:-64])), {}, ["truncated"]),
}


class Wrapped(nn.Module):
    """The same layers under another name: every key differs ("0.weight" -> "net.0.weight")."""

    def __init__(self, inner):
        super().__init__()
        self.net = inner

    def forward(self, x):
        return self.net(x)


def target(hidden=16, opt="adamw", sched="lambda", wrap=False, drop_type=False):
    mp, scheduler = make(opt=opt, hidden=hidden, sched=sched)
    if wrap:   # rebuild the engine around a renamed model with the same parameters
        model = Wrapped(tiny_model(0, hidden=hidden))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mp = MixedPrecision(model, optimizer, "fp16-pure")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s)
    return mp, scheduler


@pytest.mark.parametrize("case", list(MATRIX))
def test_a_refused_load_changes_nothing(tmp_path, case):
    write, target_kwargs, words = MATRIX[case]
    path = tmp_path / "ck.pt"
    drop_type = target_kwargs.pop("drop_type", False)
    write(path)
    if drop_type:
        surgery_state = read_verified(path, torch.device("cpu"))
        _old_file_adam_into_sgd(surgery_state)
        write_verified(path, surgery_state)
    mp, scheduler = target(**target_kwargs)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = snapshot(mp, scheduler)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, mp, scheduler=scheduler)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message, (word, message)
    assert_same(before, snapshot(mp, scheduler))
    assert_still_trains(mp)     # nothing half-restored to trip over


def test_adamw_into_sgd_names_both_types_and_step_still_works(tmp_path):
    path = save_checkpoint(tmp_path / "ck.pt", make()[0])
    mp, _ = make(opt="sgd", sched=None)
    with pytest.raises(CheckpointError, match=r"holds AdamW state but the engine's optimizer is SGD"):
        load_checkpoint(path, mp)
    assert mp.optimizer.param_groups[0]["lr"] == 0.1
    assert all("exp_avg" not in s for s in mp.optimizer.state.values())


def test_scheduler_state_is_dropped_only_when_asked(tmp_path):
    source, sched = make()
    path = save_checkpoint(tmp_path / "ck.pt", source, scheduler=sched, extra={"step": 2})
    mp, _ = make(sched=None, seed=5)
    assert load_checkpoint(path, mp, ignore_scheduler=True) == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(source.master.masters, mp.master.masters))


def test_engine_load_state_dict_is_all_or_nothing():
    mp, _ = make()
    state = mp.state_dict()
    state["master"]["masters"][-1] = torch.zeros(3)          # the last master is misshapen
    other, _ = make(seed=4)
    before = snapshot(other, None)
    with pytest.raises(ValueError, match="master weight 3"):
        other.load_state_dict(state)
    assert_same(before, snapshot(other, None))               # the loss scale was not loaded either


def test_engine_load_state_dict_of_something_else_says_what_it_got():
    mp, _ = make()
    before = snapshot(mp, None)
    with pytest.raises(ValueError, match=r"mixprec state is a dict without 'recipe' \(keys \['0.bias', "
                                         r"'0.weight'.*not what mp.state_dict\(\) returns"):
        mp.load_state_dict(mp.model.state_dict())           # the model's state, not the engine's
    with pytest.raises(ValueError, match="mixprec state is NoneType"):
        mp.load_state_dict(None)
    assert_same(before, snapshot(mp, None))


@pytest.mark.parametrize("call, flag", [
    (lambda mp, s, path: save_checkpoint(path.with_name("new.pt"), mp, rng="no"), "rng"),
    (lambda mp, s, path: load_checkpoint(path, mp, scheduler=s, rng="no"), "rng"),
    (lambda mp, s, path: load_checkpoint(path, mp, scheduler=s, weights_only="no"), "weights_only"),
    (lambda mp, s, path: load_checkpoint(path, mp, ignore_scheduler="yes"), "ignore_scheduler"),
])
def test_a_switch_that_is_not_a_bool_is_refused_before_anything(tmp_path, call, flag):
    # rng="no" is truthy: the save kept the RNG states and the load restored them, against the words.
    saved()(tmp_path / "ck.pt")
    mp, scheduler = make(seed=5)
    before = snapshot(mp, scheduler)
    with pytest.raises(TypeError, match=rf"\({flag}=...\) takes True or False, got str"):
        call(mp, scheduler, tmp_path / "ck.pt")
    assert_same(before, snapshot(mp, scheduler))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]     # the save wrote nothing


# ----------------------------------------------------------------------------- I/O errors
def test_saving_onto_a_directory_names_it_and_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory: .*give a file name") as info:
        save_checkpoint(tmp_path, make()[0])
    assert str(tmp_path) in str(info.value) and ".tmp" not in str(info.value)


def test_loading_a_directory_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file"):
        load_checkpoint(tmp_path, make()[0])


def test_a_folder_path_through_a_file_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="could not be written.*a part of the folder path is a file"):
        save_checkpoint(tmp_path / "afile" / "ck.pt", make()[0])


def test_a_read_only_filesystem_names_the_users_path(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / ".ck.pt.abc.tmp"))
    monkeypatch.setattr(mixprec.checkpoint.verified.tempfile, "mkstemp", read_only)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path / "ck.pt", make()[0])
    message = str(info.value)
    assert message.startswith(str(tmp_path / "ck.pt")) and "Read-only file system" in message
    assert ".tmp" not in message and "writable folder" in message


class Custom:
    pass


def test_weights_only_hint_comes_first_and_short(tmp_path):
    mp, _ = make()
    path = save_checkpoint(tmp_path / "ck.pt", mp, extra={"obj": Custom()})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, mp)
    message = str(info.value).replace(str(path), "PATH")     # the hint's place, whatever tmp_path's length
    assert "weights_only=False" in message[:200] and "\x1b" not in message and len(message) < 500
    assert load_checkpoint(path, mp, weights_only=False)["obj"].__class__ is Custom


def test_a_failure_the_checks_do_not_know_puts_everything_back(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    saved()(path)
    mp, scheduler = make()
    before = snapshot(mp, scheduler)

    def broken(state):   # fails last: model, engine, optimizer and scheduler are already overwritten
        raise RuntimeError("injected")
    monkeypatch.setattr(mixprec.checkpoint.files, "_set_rng_state", broken)
    with pytest.raises(CheckpointError, match="restoring failed after every check passed .injected.*"
                                              "put back as they were"):
        load_checkpoint(path, mp, scheduler=scheduler)
    monkeypatch.undo()
    assert_same(before, snapshot(mp, scheduler))
    assert_still_trains(mp)


def test_a_failure_of_the_rng_restore_puts_the_rng_back_too(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    saved()(path)
    mp, scheduler = make()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = snapshot(mp, scheduler)
    real = np.random.set_state
    calls = []

    def fails_once(state):   # torch's and Python's generators are set by then
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("injected")
        real(state)
    monkeypatch.setattr(mixprec.checkpoint.files.np.random, "set_state", fails_once)
    with pytest.raises(CheckpointError, match="put back as they were"):
        load_checkpoint(path, mp, scheduler=scheduler)
    assert_same(before, snapshot(mp, scheduler))


def test_when_putting_back_fails_too_the_message_says_partly_restored(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "ck.pt", make()[0])
    mp, _ = make(sched=None)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(mp.optimizer, "load_state_dict", broken)
    monkeypatch.setattr(mixprec.checkpoint.files._Snapshot, "restore", broken)
    with pytest.raises(CheckpointError, match="putting the engine back failed too.*partly restored"):
        load_checkpoint(path, mp)

"""Checkpoints: kill-and-resume is bit-identical, and damaged files fail with the file's name."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec import CheckpointError, MixedPrecision, load_checkpoint, save_checkpoint

from conftest import batches, tiny_model

SCRIPT = Path(__file__).with_name("_resume_script.py")


def run(recipe, ckpt, total, kill_at=0, resume=False):
    return subprocess.run([sys.executable, str(SCRIPT), recipe, str(ckpt), str(total), str(kill_at),
                           "1" if resume else "0"], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-sr",
                                    "params=fp32,compute=fp16,master=none,scale=dynamic(growth_interval=2)",
                                    "compute=bf16,fp8=delayed(history=4,amax=max)"])
def test_killed_run_resumes_bit_for_bit(tmp_path, recipe):
    whole = run(recipe, tmp_path / "whole.ckpt", total=9)
    assert whole.returncode == 0, whole.stderr
    killed = run(recipe, tmp_path / "cut.ckpt", total=9, kill_at=6)
    assert killed.returncode == -signal.SIGKILL
    resumed = run(recipe, tmp_path / "cut.ckpt", total=9, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == whole.stdout          # weights, masters, scale and skip count
    assert whole.stdout.split()[2] == "1"          # the planted overflow was skipped in both
    if "fp8" in recipe:                            # the digest covers the amax histories too
        assert whole.stdout.split()[3] == "2"      # two fp8 layers


def engine(recipe="fp16-pure", seed=0):
    model = tiny_model(seed)
    return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)


def trained(recipe="fp16-pure"):
    mp = engine(recipe)
    for x, y in batches(3):
        with mp.autocast():
            loss = F.cross_entropy(mp.model(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return mp


def test_round_trip_restores_everything(tmp_path):
    mp = trained()
    path = save_checkpoint(tmp_path / "a" / "ck.pt", mp, extra={"step": 3, "note": "hi"})
    fresh = engine(seed=5)
    assert load_checkpoint(path, fresh) == {"step": 3, "note": "hi"}
    for a, b in zip(mp.model.state_dict().values(), fresh.model.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(mp.master.masters, fresh.master.masters):
        assert torch.equal(a, b)
    assert fresh.scale == mp.scale and fresh.steps == 3
    assert list(tmp_path.joinpath("a").iterdir()) == [path]      # no temporary file left behind


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-100], "truncated"),
    (lambda b: b[:30], "truncated inside its header"),
    (lambda b: b[:-50] + bytes([b[-50] ^ 1]) + b[-49:], "checksum mismatch"),
    (lambda b: b"PK\x03\x04" + b[4:], "not a mixprec checkpoint"),
])
def test_damaged_checkpoint_is_refused_and_changes_nothing(tmp_path, damage, message):
    path = save_checkpoint(tmp_path / "ck.pt", trained())
    path.write_bytes(damage(path.read_bytes()))
    fresh = engine(seed=5)
    before = [t.clone() for t in fresh.model.state_dict().values()]
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path, fresh)
    assert str(path) in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.state_dict().values()))


def test_missing_file_and_wrong_recipe_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_checkpoint(tmp_path / "nope.pt", engine())
    path = save_checkpoint(tmp_path / "ck.pt", trained("fp16-pure"))
    with pytest.raises(CheckpointError, match="saved under recipe"):
        load_checkpoint(path, engine("bf16-pure"))


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    mp = trained()
    path = save_checkpoint(tmp_path / "ck.pt", mp, extra={"step": 1})
    good = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(mixprec.checkpoint.verified.os, "replace", crash)
    with pytest.raises(CheckpointError, match="disk full") as info:
        save_checkpoint(path, mp, extra={"step": 2})
    assert str(path) in str(info.value) and ".tmp" not in str(info.value)   # the user's path, not ours
    assert path.read_bytes() == good and list(tmp_path.iterdir()) == [path]


# ----------------------------------------------------------------------------- argument mistakes (issue 24)
def _files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def sched_of(mp):
    return torch.optim.lr_scheduler.LambdaLR(mp.optimizer, lambda s: 0.9 ** s)


@pytest.mark.parametrize("call, error, words", [
    (lambda d, mp: save_checkpoint(d / "ck.pt", mp, scheduler=mp.optimizer), TypeError,
     ["got an optimizer (AdamW)", "pass the LR scheduler"]),
    (lambda d, mp: save_checkpoint(d / "ck.pt", mp, scheduler=object()), TypeError,
     ["got a object", "no state_dict()/load_state_dict()"]),
    (lambda d, mp: save_checkpoint(d / "ck.pt", mp, scheduler=sched_of(engine())), ValueError,
     ["bound to another optimizer", "mp.optimizer"]),
    (lambda d, mp: save_checkpoint(None, mp), TypeError, ["file path", "got NoneType"]),
    (lambda d, mp: save_checkpoint(mp, d / "ck.pt"), TypeError, ["path first", "save_checkpoint(path, engine)"]),
    (lambda d, mp: save_checkpoint(d / "ck.pt", mp.model), TypeError, ["bare model (Sequential)", "MixedPrecision("]),
    (lambda d, mp: save_checkpoint(d / "ck.pt", mp, extra={"fn": lambda: 1}), TypeError,
     ["extra=", "cannot be pickled", "function by name"]),
    (lambda d, mp: save_checkpoint(str(d / "run") + "/", mp), CheckpointError,
     ["names a folder", "step_1000.ckpt"]),
])
def test_save_argument_mistakes_are_named_before_anything_is_written(tmp_path, call, error, words):
    mp = trained()
    with pytest.raises(error) as info:
        call(tmp_path, mp)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert _files(tmp_path) == []                  # no file, no folder "run", no temporary file


@pytest.mark.parametrize("call, error, words", [
    (lambda p, mp: load_checkpoint(p, mp.model), TypeError, ["bare model (Sequential)", "load_checkpoint(path, mp)"]),
    (lambda p, mp: load_checkpoint(mp, p), TypeError, ["path first", "load_checkpoint(path, engine)"]),
    (lambda p, mp: load_checkpoint(p, mp, scheduler=sched_of(engine())), ValueError,
     ["bound to another optimizer"]),
    (lambda p, mp: load_checkpoint(p, mp, scheduler=mp.optimizer), TypeError, ["got an optimizer"]),
    (lambda p, mp: load_checkpoint(p, mp, scheduler=object()), TypeError, ["no state_dict()"]),
])
def test_load_argument_mistakes_are_named_and_change_nothing(tmp_path, call, error, words):
    source = trained()
    path = save_checkpoint(tmp_path / "ck.pt", source, scheduler=sched_of(source))
    mp = engine(seed=5)
    before = [t.clone() for t in mp.model.state_dict().values()]
    with pytest.raises(error) as info:
        call(path, mp)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert all(torch.equal(a, b) for a, b in zip(before, mp.model.state_dict().values()))


# ----------------------------------------------------------------------------- stale temporary files
def test_a_later_save_removes_the_temporary_file_a_killed_save_left(tmp_path):
    mp = trained()
    stale = tmp_path / ".ck.pt.ab12cd_3.tmp"            # what a save killed mid-write leaves: no lock held
    stale.write_bytes(b"\0" * 4096)
    other = tmp_path / ".ck.pt.abc.ab12cd_3.tmp"        # a temporary file of another target, ck.pt.abc
    other.write_bytes(b"\0")
    path = save_checkpoint(tmp_path / "ck.pt", mp)
    assert _files(tmp_path) == [other.name, "ck.pt"]
    assert load_checkpoint(path, engine(seed=5)) is None


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    live = tmp_path / ".ck.pt.zz99yy_8.tmp"             # another process is writing it: it holds the lock
    live.write_bytes(b"\0")
    with open(live, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        save_checkpoint(tmp_path / "ck.pt", trained())
        assert live.exists()
    save_checkpoint(tmp_path / "ck.pt", trained())       # the writer is gone: now it is stale
    assert _files(tmp_path) == ["ck.pt"]


def test_a_killed_save_leaves_a_temporary_file_the_next_save_removes(tmp_path):
    # A real SIGKILL inside the write: the child holds the lock, the kernel drops it when the child dies.
    code = ("import os, signal, sys, torch; sys.path.insert(0, %r)\n"
            "import mixprec.checkpoint.files as c, mixprec.checkpoint.verified as v\n"
            "from conftest import tiny_model\n"
            "m = tiny_model(); mp = c.MixedPrecision(m, torch.optim.AdamW(m.parameters()), 'fp16-pure')\n"
            "def die(*a, **k): os.kill(os.getpid(), signal.SIGKILL)\n"
            "v.os.fsync = die\n"
            "c.save_checkpoint(sys.argv[1], mp)\n") % str(Path(__file__).parent)
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck.pt")], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    left = _files(tmp_path)
    assert len(left) == 1 and left[0].startswith(".ck.pt.") and left[0].endswith(".tmp")
    save_checkpoint(tmp_path / "ck.pt", trained())
    assert _files(tmp_path) == ["ck.pt"]

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
    monkeypatch.setattr(mixprec.checkpoint.os, "replace", crash)
    with pytest.raises(CheckpointError, match="disk full") as info:
        save_checkpoint(path, mp, extra={"step": 2})
    assert str(path) in str(info.value) and ".tmp" not in str(info.value)   # the user's path, not ours
    assert path.read_bytes() == good and list(tmp_path.iterdir()) == [path]

"""read_checkpoint and `mixprec ckpt show`: a checkpoint opens without an engine, verified, summed up by
role; torch.load on one says how to open it."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec import CheckpointError, MixedPrecision, read_checkpoint, save_checkpoint
from mixprec.checkpoint.verified import _MAGIC, read_verified, write_verified

from conftest import batches, tiny_model


def saved(tmp_path, recipe="fp16-pure", steps=3, boom=()):
    model = tiny_model()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    for i, (x, y) in enumerate(batches(steps)):
        with mp.autocast():
            loss = F.cross_entropy(mp.model(x), y)
        mp.backward(loss * (float("inf") if i in boom else 1.0))
        mp.step()
        mp.zero_grad()
    return save_checkpoint(tmp_path / "a.ckpt", mp, extra={"step": steps})


def test_read_checkpoint_says_what_an_fp16_pure_checkpoint_holds(tmp_path):
    info = read_checkpoint(saved(tmp_path, boom=(1,)))
    assert info.recipe == str(mixprec.get_recipe("fp16-pure"))
    # 3 steps, the planted overflow skipped and S halved once from 65536.
    assert (info.steps, info.skipped) == (3, 1) and info.loss_scale == 2.0**15
    assert info.optimizer_type == "AdamW" and info.scheduler_type is None
    # tiny_model: Linear(8, 16) 144 + LayerNorm(16) 32 + Linear(16, 4) 68 = 244 parameters in 6 tensors;
    # fp16-pure holds the two Linears (212) in fp16 and the LayerNorm (32) in fp32.
    model = info.group("model")
    assert (model.tensors, model.numel, model.nbytes) == (6, 244, 212 * 2 + 32 * 4)
    assert model.dtypes == {"float16": 4, "float32": 2}
    master = info.group("master")          # fp32 copies of the four fp16 tensors
    assert (master.tensors, master.numel, master.nbytes, master.dtypes) == (4, 212, 212 * 4, {"float32": 4})
    # AdamW: exp_avg and exp_avg_sq per parameter (fp32, 244 each) and a () fp32 step per parameter.
    opt = info.group("optimizer")
    assert (opt.tensors, opt.numel, opt.nbytes) == (18, 2 * 244 + 6, (2 * 244 + 6) * 4)
    assert info.group("fp8").tensors == 0 and info.state["extra"] == {"step": 3}
    text = info.summary()
    assert "checksum verified" in text and "steps       3 (1 skipped)" in text and "loss scale  32768" in text
    assert "fp32 master weights" in text and "fp8 scales" not in text     # empty roles are left out


def test_a_recipe_without_a_loss_scale_shows_none(tmp_path):
    info = read_checkpoint(saved(tmp_path, "bf16", steps=2))
    assert info.loss_scale is None and info.steps == 2 and info.group("master").tensors == 0
    assert "loss scale  none" in info.summary()


@pytest.mark.parametrize("weights_only", [True, False])
def test_torch_load_on_a_checkpoint_says_how_to_open_it(tmp_path, weights_only):
    # Was "UnpicklingError: ... Unsupported operand 80". torch.load meets the header's global first and runs
    # it: with weights_only=False as any global, with torch's default weights_only=True because mixprec
    # allowlists it (it only raises). Before that, weights_only=True stopped at the global's name, at the
    # end of torch's own long message.
    path = saved(tmp_path, steps=1)
    with pytest.raises(CheckpointError, match=r"torch.load cannot read it. Open it with "
                                              r"mixprec.read_checkpoint\(path\).*mixprec ckpt show"):
        torch.load(path, weights_only=weights_only)
    # Allowlisted under the name the header on disk spells (mixprec.checkpoint), not the module it lives in.
    assert (mixprec.checkpoint.use_mixprec_read_checkpoint, "mixprec.checkpoint.use_mixprec_read_checkpoint") \
        in torch.serialization.get_safe_globals()


def test_torch_load_where_mixprec_was_never_imported_still_names_the_way_in(tmp_path):
    path = saved(tmp_path, steps=1)
    proc = subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(path)!r})"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "use_mixprec_read_checkpoint" in proc.stderr


def _rewritten(path, edit):
    state = read_verified(path, torch.device("cpu"))
    edit(state)
    write_verified(path, state)
    return path


def test_wrong_arguments_and_crafted_parts_are_named_not_tracebacks(tmp_path):
    with pytest.raises(TypeError, match=r"read_checkpoint needs a file path .* got NoneType"):
        read_checkpoint(None)                       # was pathlib's "expected str, bytes or os.PathLike"
    path = saved(tmp_path, steps=1)
    with pytest.raises(TypeError, match=r"weights_only=...\) takes True or False, got 'no'"):
        read_checkpoint(path, weights_only="no")    # was taken as True
    # A checksummed payload whose loss scale is a list was an AttributeError; a mixprec part that is a list
    # was summed up as recipe 'unknown'.
    with pytest.raises(CheckpointError, match="payload's loss scale part is list, not the dict"):
        read_checkpoint(_rewritten(path, lambda s: s["mixprec"].__setitem__("loss_scale", [1])))
    with pytest.raises(CheckpointError, match="payload's mixprec part is list, not the dict"):
        read_checkpoint(_rewritten(saved(tmp_path, steps=1), lambda s: s.__setitem__("mixprec", [1])))
    # A count that is not one number (it was "a Tensor with 3 elements cannot be converted") is left out.
    info = read_checkpoint(_rewritten(saved(tmp_path, steps=1),
                                      lambda s: s["mixprec"]["loss_scale"].__setitem__("steps", torch.zeros(3))))
    assert info.steps is None and info.skipped == 0 and info.loss_scale == 2.0**16


def test_a_file_with_the_old_header_still_reads(tmp_path):
    path = saved(tmp_path, steps=1)
    data = path.read_bytes()
    path.write_bytes(b"MIXPREC-CHECKPOINT v1\n" + data[len(_MAGIC):])
    assert read_checkpoint(path).steps == 1


def test_an_altered_file_is_refused_with_its_fault(tmp_path):
    path = saved(tmp_path, steps=1)
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_checkpoint(path)
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        read_checkpoint(tmp_path / "missing.ckpt")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mixprec.lab.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_ckpt_show_prints_the_summary_and_json(tmp_path):
    path = saved(tmp_path, boom=(1,))
    proc = _cli("ckpt", "show", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == read_checkpoint(path).summary()
    proc = _cli("ckpt", "show", str(path), "--json")
    data = json.loads(proc.stdout)
    assert (data["steps"], data["skipped"], data["loss_scale"]) == (3, 1, 32768.0)
    assert {g["role"]: g["tensors"] for g in data["groups"]}["master"] == 4


def test_ckpt_show_refuses_a_bad_file_in_one_line(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    proc = _cli("ckpt", "show", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"mixprec: error: {bad}: not a mixprec checkpoint (no mixprec header)"]


def test_a_kahan_checkpoint_names_its_compensations_not_fp32_masters(tmp_path):
    # Issue 33: bf16-kahan's int16 compensations were listed as "fp32 master weights".
    model = tiny_model()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-kahan")
    text = read_checkpoint(save_checkpoint(tmp_path / "k.pt", mp)).summary()
    assert "Kahan compensations (int16)" in text and "fp32 master" not in text


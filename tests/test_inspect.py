"""``mixprec inspect`` end to end, in process: tables on stdout, the strict JSON, and user mistakes."""

import json
import textwrap

import pytest

from mixprec.lab.cli import main

N_MLP = 64 * 256 + 256 + 256 * 10 + 10       # the built-in mlp: 64-256-10


def _strict(text):
    def bad(word):
        raise AssertionError(f"non-strict JSON constant {word}")
    return json.loads(text, parse_constant=bad)


def test_inspect_mlp_tables_and_json(tmp_path, capsys):
    path = tmp_path / "inspect.json"
    assert main(["inspect", "--workload", "mlp", "--recipes", "fp32,fp16-pure", "--device", "cpu",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "memory of one training step of mlp" in out and "fp16-pure" in out and "addmm" in out
    report = _strict(path.read_text())
    assert report["schema_version"] == 1 and report["kind"] == "inspect" and report["measured"] is True
    assert report["kernels"] == []                 # profiled on CUDA only
    fp32, pure = report["memory"]
    assert fp32["n_params"] == N_MLP
    # AdamW: weights 4 + grads 4 + two moments 8 = 16 B/param, and the prediction is what one real step held.
    assert fp32["predicted"]["params"] == 4 * N_MLP and fp32["predicted"]["optimizer"] == 8 * N_MLP + 4 * 4
    for m in (fp32, pure):
        # The predicted peak is above every saved byte; on a CPU nothing measures a peak.
        assert m["predicted"].pop("peak") > sum(m["predicted"].values()) and m["measured"]["peak"] is None
        m["measured"].pop("peak")
        assert m["predicted"] == m["measured"]
    assert pure["predicted"]["params"] == 2 * N_MLP and pure["predicted"]["master"] == 4 * N_MLP
    # The head has 10 outputs: every matmul touching it misses the multiple of 8.
    head = [op for op in report["matmuls"] if op["module"] == "2"]
    assert len(head) == 3 and all(op["flops"] == 2 * 64 * 256 * 10 for op in head)
    assert report["misaligned_share"]["8"] == pytest.approx(sum(op["flops"] for op in head)
                                                            / report["matmul_flops"])
    assert [(f["size"], f["pad_to"]) for f in report["fixes"]["8"]] == [(10, 16)]


def test_inspect_gpt2_benchmark_is_predicted_only_on_cpu(tmp_path, capsys):
    path = tmp_path / "gpt2.json"
    assert main(["inspect", "--benchmark", "gpt2", "--recipes", "bf16", "--device", "cpu",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "predicted only" in out
    report = _strict(path.read_text())
    assert report["measured"] is False and report["memory"][0]["measured"] is None
    (bf16,) = report["memory"]
    assert bf16["n_params"] == 124_475_904 and bf16["predicted"]["params"] == 4 * 124_475_904
    head = [op for op in report["matmuls"] if op["module"] == "lm_head"]
    assert [op["flops"] for op in head] == [2 * (12 * 1024) * 768 * 50304] * 3
    assert report["misaligned_share"]["8"] == 0.0      # the padded vocabulary, 50304 = 786 * 64


@pytest.mark.parametrize("args, words", [
    (["--recipes", "fp17"], "unknown recipe 'fp17'"),
    (["--workload", "resnet"], "unknown workload 'resnet'"),
    (["--batch-size", "0"], "batch size must be a positive integer"),
    (["--batch-size", "5000"], "more than the 1437 training rows"),
    (["--device", "cuda:7"], "cuda"),
])
def test_user_mistakes_are_one_line(args, words, capsys):
    assert main(["inspect", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec: error: ") and words in err and err.count("\n") == 1


_WORKLOAD = """
import torch, torch.nn.functional as F
from torch import nn
from mixprec.lab.workloads import Split

{model}

def workload():
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    return {{"model": Model(), "data": Split(x[:32], y[:32], x[32:], y[32:]),
            "loss": F.cross_entropy, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1), "batch_size": 8}}
"""


def _user_module(tmp_path, monkeypatch, name, model_source):
    (tmp_path / f"{name}.py").write_text(_WORKLOAD.format(model=textwrap.dedent(model_source).strip()))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:workload"


def test_workload_without_parameters(tmp_path, monkeypatch, capsys):
    spec = _user_module(tmp_path, monkeypatch, "noparams", """
        class Model(nn.Module):
            def forward(self, x):
                return x[:, :2]
    """)
    assert main(["inspect", "--workload", spec, "--device", "cpu"]) == 2
    assert "has no trainable parameters: there is nothing to train or inspect" in capsys.readouterr().err


def test_model_that_cannot_be_traced_says_why(tmp_path, monkeypatch, capsys):
    spec = _user_module(tmp_path, monkeypatch, "datadependent", """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 2)
            def forward(self, x):
                y = self.lin(x)
                return y if y.sum() > 0 else -y      # reads a value
    """)
    assert main(["inspect", "--workload", spec, "--device", "cpu", "--recipes", "fp32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec: error: cannot trace Model on the meta device") and err.count("\n") == 1


def test_a_recipe_the_device_cannot_run_is_predicted_only(tmp_path, capsys):
    path = tmp_path / "tf32.json"
    assert main(["inspect", "--recipes", "fp32,tf32", "--device", "cpu", "--json", str(path)]) == 0
    assert "tf32: tf32 needs an NVIDIA GPU" in capsys.readouterr().out
    fp32, tf32 = _strict(path.read_text())["memory"]
    # TF32 rounds matmul inputs; it stores what fp32 stores.
    assert tf32["measured"] is None and tf32["predicted"] == fp32["predicted"]
    assert {**fp32["predicted"], "peak": None} == fp32["measured"]

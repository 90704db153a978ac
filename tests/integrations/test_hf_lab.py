"""The lab and the memory report on Hugging Face models: ModelOutput results and dict batches."""

import json
import math

import torch
from optional_deps import need

import mixprec
from mixprec.lab.cli import main

need("transformers")
import hf_tiny  # noqa: E402


def test_compare_runs_an_hf_workload_end_to_end(tmp_path, capsys):
    path = tmp_path / "report.json"
    code = main(["compare", "--workload", "hf_workload:gpt2_tiny", "--recipes", "fp32,bf16,fp8",
                 "--steps", "4", "--device", "cpu", "--json", str(path)])
    assert code == 0, capsys.readouterr().err
    runs = json.loads(path.read_text())["runs"]
    assert [r["label"] for r in runs] == ["fp32", "bf16", "fp8"]
    for run in runs:
        assert math.isfinite(run["test_metric"]) and 0 < run["test_metric"] < 10   # nats per token
    # bf16 evaluates within bf16 rounding of fp32 after 4 identical-seed steps.
    assert abs(runs[1]["test_metric"] - runs[0]["test_metric"]) < 0.05


def test_memory_report_takes_a_dict_batch_and_the_models_own_loss():
    model, make_batch, _ = hf_tiny.llama()
    ids = make_batch(0)
    batch = {"input_ids": ids, "labels": ids}
    for recipe in ("fp32", "bf16-pure"):
        report = mixprec.memory_report(model, recipe, batch, measure=True)
        assert report.predicted.activations == report.measured.activations > 0
    # (inputs, targets) with a loss function also takes a dict of inputs.
    report = mixprec.memory_report(model, "bf16", ({"input_ids": ids}, ids),
                                   loss_fn=lambda out, y: out.logits.float().mean())
    assert report.predicted.activations > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())   # the model was left alone

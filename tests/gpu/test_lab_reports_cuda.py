"""CUDA-only: the inspect report's kernel profiles (written only on a GPU) go through the codec and back."""

import json

import pytest
import torch

from mixprec.lab.cli import main
from mixprec.lab.inspect.report import InspectReport

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def test_inspect_on_cuda_profiles_each_recipe_and_its_report_reads_back(tmp_path, capsys):
    path = tmp_path / "inspect.json"
    assert main(["inspect", "--workload", "mlp", "--recipes", "fp32,fp16", "--device", "cuda",
                 "--json", str(path)]) == 0
    assert "of GPU kernel time in tensor-core kernels" in capsys.readouterr().out
    text = path.read_text()
    report = InspectReport.from_json(text)
    assert [k.recipe for k in report.kernels] == [m.recipe for m in report.memory]
    assert all(k.kernels and 0.0 <= k.tensor_core_share <= 1.0 for k in report.kernels)
    assert report.kernels[1].tensor_core_share > 0.0          # fp16 matmuls run on tensor cores
    assert InspectReport.from_json(report.to_json()) == report
    data = json.loads(text)
    assert data["kernels"][1]["tensor_core_share"] == report.kernels[1].tensor_core_share

"""``mixprec doctor`` end to end in a subprocess: the report (JSON, HTML, table) and every usage error."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.diagnostics.range_collector import KINDS
from mixprec.lab.cli import main
from mixprec.lab.doctor.render_fp8 import fp8_swap_lines, render_fp8_findings
from mixprec.lab.doctor.render import layer_rows
from mixprec.lab.doctor.report import DoctorReport

TESTS = Path(__file__).parent
STEPS = 3


def _cli(*args, cwd=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "mixprec.lab.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor")
    proc = _cli("--workload", "mlp", "--steps", str(STEPS), "--device", "cpu", "--out", str(out),
                "--json", str(out / "copy.json"), "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    return proc, out


def test_json_report_holds_every_module_and_kind(run):
    _, out = run
    data = json.loads((out / "doctor.json").read_text())
    assert data["kind"] == "doctor" and data["workload"] == "mlp" and data["steps"] == STEPS
    assert data["recipe"] == "params=fp32,compute=fp16,master=none,scale=dynamic"
    assert [m["name"] for m in data["modules"]] == ["0", "1", "2"]       # Linear, ReLU, Linear
    linear = data["modules"][0]
    assert set(linear["stats"]) == set(KINDS)
    assert set(data["modules"][1]["stats"]) == {"activations", "activation_grads"}   # ReLU: no weights
    # Every value is counted once per step: 64 samples x 256 hidden units of output, 64*256+256 weights.
    assert linear["stats"]["activations"]["count"] == STEPS * 64 * 256
    assert linear["stats"]["weights"]["count"] == STEPS * (64 * 256 + 256)
    for stats in linear["stats"].values():
        for counts in stats["formats"].values():
            assert sum(counts.values()) == stats["count"]
        assert sum(n for _, n in stats["exponents"]) == stats["count"] - stats["zeros"] - stats["nonfinite"]
    assert data["scales"] == [65536.0] * STEPS
    w = data["window"]
    assert w["low"] <= w["recommended"] == w["high"]
    assert w["below_floor_unscaled"] < 0.01        # the digits MLP needs no loss scale (cf. test_beam)


def test_report_round_trips_and_renders(run):
    proc, out = run
    text = (out / "doctor.json").read_text()
    assert text == (out / "copy.json").read_text()
    report = DoctorReport.from_json(text)
    assert DoctorReport.from_json(report.to_json()) == report
    assert json.loads(report.to_json()) == json.loads(text)
    rows = layer_rows(report)
    assert [r.severity for r in rows] == sorted((r.severity for r in rows), reverse=True)
    page = (out / "doctor.html").read_text()
    assert page.count("<img") == 1 + len(report.modules)      # the overview and one per module
    assert "http" not in page.replace("http-equiv", "")        # self-contained
    assert "loss scale:" in proc.stdout and "grad<2^-24" in proc.stdout


def test_the_page_has_an_index_to_every_layer(run):
    # The gpt page is ~8,300 px of histograms: each layer's figure is one link away.
    _, out = run
    page = (out / "doctor.html").read_text()
    report = DoctorReport.from_json((out / "doctor.json").read_text())
    index = re.search(r'<nav class="index" id="layer-index">(.*?)</nav>', page).group(1)
    targets = re.findall(r'href="#([^"]+)"', index)
    assert targets == [f"plot-{m.name or 'model'}" for m in report.modules]
    assert all(f'<figure id="{t}">' in page for t in targets)
    top = re.search(r'<nav class="top">(.*?)</nav>', page).group(1)
    assert all(f'id="{t}"' in page for t in re.findall(r'href="#([^"]+)"', top))


def test_histogram_legends_sit_above_the_axes_not_over_the_bars():
    # A "best" legend covered bars (beam layer 2, gpt blocks.0.ln_1): it now sits wholly above the axes.
    from mixprec.diagnostics.range_histogram import RangeHistogram
    from mixprec.lab.doctor.html import _layer_figure
    hist = RangeHistogram("cpu")
    hist.add(torch.logspace(-30, 10, 200, base=2.0))
    stats = hist.result()
    fig = _layer_figure(stats, stats, shift=8, run_shift=16)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.y0 >= ax.get_window_extent(renderer).y1 - 1     # above the plotting area


def test_a_non_fp8_run_has_no_fp8_section(run):
    proc, out = run
    data = json.loads((out / "doctor.json").read_text())
    assert data["fp8_layers"] == [] and data["fp8_swap"] is None
    report = DoctorReport.from_json(json.dumps(data))
    assert report.fp8_layers == () and report.fp8_swap is None
    assert render_fp8_findings(report) == [] and fp8_swap_lines(report.fp8_swap) == []
    assert "fp8 tensors" not in proc.stdout and 'id="fp8"' not in (out / "doctor.html").read_text()


def test_bad_json_is_refused():
    with pytest.raises(ValueError, match="not a mixprec doctor report"):
        DoctorReport.from_json('{"kind": "compare"}')
    with pytest.raises(ValueError, match="invalid JSON"):
        DoctorReport.from_json("{")


@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], ["steps must be at least 1"]),
    (["--workload", "gpt", "--steps", "1", "--modules", "blocks.0.atn"], ["did you mean 'blocks.0.attn'"]),
    (["--steps", "1", "--modules", ","], ["--modules is empty"]),
    (["--steps", "1", "--recipe", "fp17"], ["unknown recipe 'fp17'"]),
    (["--steps", "1", "--recipe", "tf32"], ["cannot run on cpu"]),
    (["--workload", "nope", "--steps", "1"], ["unknown workload 'nope'"]),
    (["--steps", "1", "--seed", "-1"], ["seed must be a non-negative integer"]),
    (["--steps", "1", "--json", "."], ["is a directory"]),
    (["--workload", "resnet50"], ["GPU benchmark"]),
])
def test_usage_errors_are_one_line_before_training(args, words, capsys):
    # In process (main() is what the console script runs): each case must stop before training.
    assert main(["doctor", *args, "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mixprec: error: "), lines
    for word in words:
        assert word in lines[0]


def test_a_workload_without_parameters_is_refused():
    # In a subprocess, as a user runs it: the user module is found from the working directory.
    proc = _cli("--workload", "doctor_workloads:no_params", "--steps", "1", "--device", "cpu", cwd=TESTS)
    assert proc.returncode == 2
    assert "has no trainable parameters" in proc.stderr and "Traceback" not in proc.stderr

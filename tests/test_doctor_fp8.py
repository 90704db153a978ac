"""``mixprec doctor`` under fp8 recipes: exact per-tensor flush/saturation counts and the swap decisions."""

import contextlib
import dataclasses
import html
import io
import json
import re

import pytest
import torch

from mixprec import MixedPrecision
from mixprec.fp8 import count_fp8_ranges, fp8_layer_stats
from mixprec.lab.cli import main
from mixprec.lab.doctor.render_fp8 import render_fp8_findings, render_fp8_table
from mixprec.lab.doctor.report import DoctorReport
from mixprec.lab.trainer import batch_order
from mixprec.lab.workloads import get_workload

STEPS = 3
BATCH, IN, HIDDEN = 64, 64, 256       # the mlp workload: Linear(64, 256), ReLU, Linear(256, 10)


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """One in-process ``mixprec doctor --recipe fp8-delayed`` run: its stdout, report and page."""
    out = tmp_path_factory.mktemp("doctor_fp8")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):       # rich's Console writes to sys.stdout as it is then
        rc = main(["doctor", "--workload", "mlp", "--recipe", "fp8-delayed", "--steps", str(STEPS),
                   "--device", "cpu", "--threads", "1", "--out", str(out)])
    assert rc == 0
    text = (out / "doctor.json").read_text()
    return buf.getvalue(), DoctorReport.from_json(text), text, (out / "doctor.html").read_text()


def _replay(recipe: str) -> tuple:
    """The doctor's training loop without the range collector: same seed, weights and batches."""
    w = get_workload("mlp")
    data = w.load_data()
    order = batch_order(len(data.y_train), w.batch_size, STEPS, 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = w.build_model()
    mp = MixedPrecision(model, w.make_optimizer(model.parameters()), recipe, seed=0)
    count_fp8_ranges(model)
    for step in range(STEPS):
        idx = order[step]
        with mp.autocast():
            loss = w.loss_fn(model(data.x_train[idx]), data.y_train[idx])
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return fp8_layer_stats(model), mp.fp8_report


def test_stats_cover_exactly_the_swapped_layers_and_match_fp8_layer_stats(fp8_run):
    _, report, _, _ = fp8_run
    assert report.fp8_swap is not None and report.fp8_swap.swapped == ("0",)
    assert dict((n, r.name) for n, r in report.fp8_swap.not_swapped.items()) == {"2": "SHAPE"}  # 10 rows
    assert [s.name for s in report.fp8_layers] == list(report.fp8_swap.swapped)
    layer = report.fp8_layers[0]
    # Every training cast of every step counted: x is (64, 64), W (256, 64), the output gradient (64, 256).
    assert {t.role: t.counted for t in layer.tensors} == {
        "input": STEPS * BATCH * IN, "weight": STEPS * HIDDEN * IN, "grad_output": STEPS * BATCH * HIDDEN}
    assert layer.tensor("input").history_amax is not None          # delayed scaling keeps a history
    # The collector's hooks must not change what fp8 sees: a plain replay gives the same stats, bit for bit.
    stats, swap = _replay("fp8-delayed")
    assert report.fp8_layers == stats and report.fp8_swap == swap


def test_json_round_trip_and_older_reports(fp8_run):
    _, report, text, _ = fp8_run
    assert DoctorReport.from_json(report.to_json()) == report
    data = json.loads(text)
    assert data["fp8_swap"]["layers"][1] == {"name": "2", "out_features": 10, "in_features": 256,
                                             "reason": "SHAPE", "detail": "pad to (16, 256)", "groups": 1}
    for layer in data["fp8_swap"]["layers"]:
        del layer["groups"]                                        # written before expert GEMMs: 1
    assert DoctorReport.from_json(json.dumps(data)).fp8_swap == report.fp8_swap
    del data["fp8_layers"], data["fp8_swap"]                       # a version-1 file from before
    old = DoctorReport.from_json(json.dumps(data))
    assert old.fp8_layers == () and old.fp8_swap is None and old.modules == report.modules
    data = json.loads(text)
    data["fp8_swap"]["layers"][0]["reason"] = "MAYBE"
    with pytest.raises(ValueError, match="does not match schema version 1"):
        DoctorReport.from_json(json.dumps(data))


def test_table_findings_and_page_name_the_fp8_tensors(fp8_run):
    stdout, report, _, page = fp8_run
    # 64 x 256 weights of 64 x 256 + 256 + 256 x 10 + 10 = 19210 parameters: 85%.
    assert "fp8: 1 of 2 linear layers swapped ('0', 85% of the parameters), backend" in stdout
    assert "not fp8: '2' (10, 256): weight dims not multiples of 16: pad to (16, 256)" in stdout
    table = render_fp8_table(report)
    assert table.row_count == 3
    assert list(table.columns[1].cells) == ["input", "weight", "grad_output"]
    assert list(table.columns[2].cells) == ["e4m3", "e4m3", "e5m2"]
    for role in ("grad_output", "weight"):
        assert f"0      {role}" in stdout
    findings = render_fp8_findings(report)
    assert findings
    # fp8 runs on bf16 compute: no fp16 flush happened, so the fp16-only advice must not appear.
    assert "does not scale the loss" not in stdout and "fp16's flush" not in stdout
    for line in findings:
        assert f"- {line}" in stdout
    assert '<h2 id="fp8">fp8</h2>' in page and "grad_output" in page and "pad to (16, 256)" in page


def test_the_fp8_page_leads_with_fp8_and_plots_its_flush_and_saturation(fp8_run):
    # The page led with fp16 loss-scale advice and drew fp16's loss-scale outlines; fp8's own flushed and
    # saturated shares were only in a table.
    _, report, _, page = fp8_run
    findings = re.findall(r"<li>(.*?)</li>", re.search(r'<ul class="notes" id="findings">(.*?)</ul>', page).group(1))
    fp8_lines = render_fp8_findings(report)
    assert findings[:len(fp8_lines)] == [html.escape(line) for line in fp8_lines]
    assert '<figure id="plot-fp8"><img' in page and "flushed to zero (red) and saturated" in page
    assert "(recommended)" not in page and "green outline" not in page
    assert html.escape("fp16's range, for reference") in page


def _with(report: DoctorReport, **changes) -> DoctorReport:
    """The report with every fp8 tensor of its one layer changed (fault injection for the findings)."""
    layer = report.fp8_layers[0]
    tensors = tuple(dataclasses.replace(t, **changes) for t in layer.tensors)
    return dataclasses.replace(report, fp8_layers=(dataclasses.replace(layer, tensors=tensors),))


def test_findings_follow_the_counts(fp8_run):
    _, report, _, _ = fp8_run
    clean = _with(report, flushed_fraction=0.0, saturated_fraction=0.0, headroom_bits=1.5)
    assert render_fp8_findings(clean) == [
        f"fp8: no value of the 1 fp8 layer(s) flushed or saturated over {STEPS} steps (least headroom: "
        "'0' input, +1.50 b)"]
    flushing = _with(report, flushed_fraction=0.25, saturated_fraction=0.0)
    (line,) = render_fp8_findings(flushing)
    assert line.startswith("fp8 underflow: layer '0', 25.0% of its input values flushed to zero in fp8_e4m3")
    assert "skip=0" in line
    delayed = _with(report, saturated_fraction=0.125, flushed_fraction=0.0, headroom_bits=-1.0)
    (line,) = render_fp8_findings(delayed)
    assert line.startswith("fp8 saturation: layer '0', 12.5% of its input values exceeded fp8_e4m3's max")
    assert "fp8=delayed(margin=1)" in line and "history=32" in line and "skip=0" in line
    current = _with(report, history_amax=None, saturated_fraction=0.5, flushed_fraction=0.0, headroom_bits=-2.0)
    (line,) = render_fp8_findings(current)
    assert "50.0% of its input values exceeded fp8_e4m3's max (last headroom -2.00 b)" in line
    assert "fp8=current(margin=1)" in line
    uncounted = _with(report, counted=0, flushed_fraction=None, saturated_fraction=None)
    assert render_fp8_findings(uncounted) == []


def test_every_recipe_the_doctor_suggests_parses_to_what_it_means(fp8_run):
    """Issue 15: the advice used to print a bare fp8=delayed(margin=1), which as --recipe runs fp32."""
    import re

    from mixprec.recipe import parse_recipe
    _, report, _, _ = fp8_run
    ran = parse_recipe(report.recipe)
    lines = (render_fp8_findings(_with(report, saturated_fraction=0.125, flushed_fraction=0.0))
             + render_fp8_findings(_with(report, history_amax=None, saturated_fraction=0.5,
                                         flushed_fraction=0.0))
             + render_fp8_findings(_with(report, flushed_fraction=0.25, saturated_fraction=0.0,
                                         history_amax=1e9)))
    suggested = [parse_recipe(text) for line in lines for text in re.findall(r"--recipe '([^']+)'", line)]
    assert len(suggested) == 7
    for r in suggested:      # everything but the fp8 options stays as the run had it (bf16 compute)
        assert r.compute is ran.compute and r.param is ran.param and r.fp8 is not None
    margins = [r for r in suggested if r.fp8.margin == 1]
    assert {r.fp8.delayed for r in margins} == {True, False}
    assert any(r.fp8.history == 32 for r in suggested) and any(r.fp8.amax == "recent" for r in suggested)
    assert all(r.fp8.skip == ("0",) for r in suggested if r.fp8.skip)
    assert "--recipe 'fp8-delayed,fp8=delayed(margin=1)'" in lines[0]

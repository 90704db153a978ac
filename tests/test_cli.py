"""``mixprec compare`` end to end, in a subprocess as a user runs it; assertions read the JSON report.

One short compare run (30 steps) is shared by the report tests; each error case starts its own process
and must fail before any training, with one line on stderr and exit status 2.
"""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from mixprec.diagnostics.memory import MemoryBreakdown
from mixprec.lab.report import SCHEMA_VERSION, CompareReport, render_notes, render_table
from mixprec.lab.trainer import RunResult, batch_order

RECIPES = ["fp32", "fp16", "bf16", "fp16-pure"]
STEPS = 30


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mixprec.lab.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "report.json"
    proc = _cli("compare", "--recipes", ",".join(RECIPES), "--steps", str(STEPS), "--device", "cpu",
                "--seed", "0", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture(scope="module")
def report_json(report_path):
    return json.loads(report_path.read_text())


# ------------------------------------------------------------------------------------ the report
def test_report_holds_every_requested_recipe_in_order(report_json):
    assert report_json["schema_version"] == SCHEMA_VERSION
    assert [r["label"] for r in report_json["runs"]] == RECIPES
    assert report_json["workload"] == "mlp"
    assert report_json["device"] == "cpu"
    assert report_json["steps"] == STEPS and report_json["seed"] == 0


def test_numbers_are_finite_and_in_range(report_json):
    for run in report_json["runs"]:
        assert len(run["losses"]) == len(run["scales"]) == STEPS
        assert all(isinstance(x, float) and math.isfinite(x) for x in run["losses"]), run["label"]
        assert math.isfinite(run["final_loss"]) and run["final_loss"] > 0
        assert 0.0 <= run["test_metric"] <= 1.0
        assert run["samples_per_s"] > 0
        assert run["skipped_steps"] == len(run["skipped_at"])
        assert run["final_scale"] == run["scales"][-1]


def test_training_learns(report_json):
    # 30 Adam steps on the digits: the loss falls from ~2.3 (ln 10) and the MLP beats chance (10%) by far.
    for run in report_json["runs"]:
        assert run["losses"][0] == pytest.approx(math.log(10), abs=0.2)
        assert run["final_loss"] < 0.5 * run["losses"][0], run["label"]
        assert run["test_metric"] > 0.5, run["label"]


def test_fp32_never_skips_and_has_no_loss_scale(report_json):
    fp32 = report_json["runs"][0]
    assert fp32["skipped_steps"] == 0 and fp32["skipped_at"] == []
    assert set(fp32["scales"]) == {1.0}


def test_fp16_recipes_use_the_dynamic_scale(report_json):
    # Default dynamic scale: init 2**16, growth every 2000 clean steps: untouched in 30 clean steps.
    for run in report_json["runs"]:
        if run["label"] in ("fp16", "fp16-pure") and run["skipped_steps"] == 0:
            assert run["final_scale"] == 2.0**16


def test_memory_by_role_matches_the_mlp_worked_out_by_hand(report_json):
    n = 64 * 256 + 256 + 256 * 10 + 10                       # the 64-256-10 MLP: 19,210 parameters
    runs = {r["label"]: r["memory"] for r in report_json["runs"]}
    assert runs["fp32"]["params"] == 4 * n and runs["fp32"]["master"] == 0
    assert runs["fp32"]["optimizer"] == 8 * n + 4 * 4       # AdamW: two fp32 moments, 4 step counters
    assert runs["fp16-pure"]["params"] == 2 * n and runs["fp16-pure"]["master"] == 4 * n
    assert runs["fp16-pure"]["grads"] == 2 * n              # fp16 grads: the fp32 copies' gradients live in step() only
    assert runs["fp16"]["activations"] < runs["fp32"]["activations"]   # saved in fp16 under autocast
    assert all(m["peak"] is None for m in runs.values())    # no CUDA allocator on the CPU


def test_eval_curve_ends_with_the_test_metric(report_json):
    for run in report_json["runs"]:
        assert run["eval_steps"] == list(range(STEPS // 10, STEPS + 1, STEPS // 10))
        assert len(run["eval_metrics"]) == len(run["eval_steps"])
        assert run["eval_metrics"][-1] == run["test_metric"]


def test_every_recipe_starts_from_the_same_weights_and_data(report_json):
    # The first loss is computed before any update: it differs only by the recipe's forward rounding
    # (bf16 has 8 bits of mantissa: relative error ~2**-8 on the logits).
    first = {r["label"]: r["losses"][0] for r in report_json["runs"]}
    for label, loss in first.items():
        assert loss == pytest.approx(first["fp32"], abs=1e-2), label


def test_report_file_reads_back_into_an_equal_report(report_path):
    report = CompareReport.from_json(report_path.read_text())
    assert CompareReport.from_json(report.to_json()) == report
    assert [r.label for r in report.runs] == RECIPES
    assert render_table(report).row_count == len(RECIPES)
    assert any("CPU" in note for note in render_notes(report))


# ----------------------------------------------------------------------------------- the errors
# Each case that would otherwise train passes --steps 1, so a missed check costs a second, not a minute.
@pytest.mark.parametrize("args, word", [
    (["compare", "--steps", "1", "--recipes", "fp17"], "fp17"),
    (["compare", "--steps", "1", "--recipes", "fp32,params=fp8"], "params"),
    (["compare", "--steps", "1", "--workload", "resnet9000"], "workload"),
    (["compare", "--steps", "1", "--recipes", "fp32,tf32", "--device", "cpu"], "tf32"),
    (["compare", "--steps", "0"], "steps"),
    (["compare", "--steps", "1", "--benchmark", "vgg"], "invalid choice"),
    (["compare", "--benchmark", "resnet50", "--device", "cpu"], "GPU benchmark"),
    (["compare", "--steps", "1", "--benchmark", "gpt2", "--workload", "mlp"], "not allowed with"),
    (["compare", "--steps", "1", "--eval-every", "0"], "eval-every"),
    (["compare", "--steps", "1", "--workload", "no_such_module_xyz:fn"], "no_such_module_xyz"),
    (["compare", "--steps", "-5"], "steps"),
    (["compare", "--steps", "many"], "--steps"),
    (["compare", "--steps", "1", "--device", "potato"], "device"),
    (["compare", "--steps", "1", "--json", "/nonexistent-dir/sub/report.json"], "does not exist"),
    (["frobnicate"], "frobnicate"),
])
def test_user_mistakes_print_one_line_and_exit_2(args, word):
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mixprec: error: ")
    assert word in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_a_directory_as_json_path_is_refused_before_training(tmp_path):
    proc = _cli("compare", "--steps", "1", "--json", str(tmp_path))
    assert proc.returncode == 2
    assert "directory" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ in-process pieces
def _run(label, **changes):
    run = RunResult(recipe="params=fp32,compute=fp32,master=none,scale=none", label=label,
                    final_loss=0.25, test_metric=0.9, samples_per_s=1e4, skipped_steps=1, final_scale=1.0,
                    losses=(2.3, 1.0, 0.1 + 0.2), scales=(1.0, 1.0, 1.0), skipped_at=(1,), wall_s=0.5,
                    eval_steps=(2, 3), eval_metrics=(0.5, 0.9),
                    memory=MemoryBreakdown(params=400, grads=400, optimizer=816, activations=1234))
    return dataclasses.replace(run, **changes)


def _report(*runs):
    return CompareReport(workload="mlp", metric="accuracy", device="cpu", device_name="x86_64 CPU",
                         threads=1, torch_version="2.x", mixprec_version="0.1.0", steps=3, batch_size=64,
                         seed=0, runs=runs)


def test_json_round_trip_is_exact_including_non_finite_losses():
    report = _report(_run("fp32"), _run("fp16", losses=(2.3, math.inf, -math.inf), final_loss=math.inf))
    text = report.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert CompareReport.from_json(text) == report


def test_nan_survives_the_round_trip():
    report = _report(_run("fp16", final_loss=math.nan), _run("gpu", memory=MemoryBreakdown(peak=10**9)))
    assert math.isnan(CompareReport.from_json(report.to_json()).runs[0].final_loss)


@pytest.mark.parametrize("mutate, word", [
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d["runs"][0].pop("losses"), "losses"),
    (lambda d: d["runs"][0].update(skipped_steps="one"), "skipped_steps"),
    (lambda d: d["runs"][0]["memory"].pop("peak"), "memory"),
])
def test_from_json_rejects_a_report_it_cannot_read(mutate, word):
    data = json.loads(_report(_run("fp32")).to_json())
    mutate(data)
    with pytest.raises(ValueError, match=word):
        CompareReport.from_json(json.dumps(data))


def test_batch_order_is_seeded_and_covers_each_epoch_once():
    order = batch_order(n=10, batch_size=4, steps=5, seed=3)   # 20 rows: two epochs of 10
    assert order.shape == (5, 4)
    assert sorted(order.flatten()[:10].tolist()) == list(range(10))
    assert sorted(order.flatten()[10:].tolist()) == list(range(10))
    assert order.equal(batch_order(n=10, batch_size=4, steps=5, seed=3))
    assert not order.equal(batch_order(n=10, batch_size=4, steps=5, seed=4))


# ------------------------------------------------------------------------- --out and mixprec report
@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "new" / "dir"          # created by --out, parents too
    proc = _cli("compare", "--recipes", "fp32,bf16", "--steps", "20", "--device", "cpu", "--threads", "1",
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"report written to {out / 'report.json'}" in proc.stderr
    assert f"HTML page written to {out / 'report.html'}" in proc.stderr
    return out


def test_compare_out_writes_the_json_report_and_its_page(out_dir):
    report = CompareReport.from_json((out_dir / "report.json").read_text())
    assert [r.label for r in report.runs] == ["fp32", "bf16"] and report.steps == 20
    page = (out_dir / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert all(f'id="plot-{p}"' in page for p in ("loss", "eval", "scale", "throughput", "memory"))


def test_report_rerenders_the_same_page_from_the_json(out_dir, tmp_path):
    other = tmp_path / "other.html"
    proc = _cli("report", str(out_dir / "report.json"), "--out", str(other))
    assert proc.returncode == 0, proc.stderr
    assert other.read_bytes() == (out_dir / "report.html").read_bytes()
    assert "fp32" in proc.stdout and "bf16" in proc.stdout            # the table, on stdout
    assert f"HTML page written to {other}" in proc.stderr


def test_report_writes_beside_the_json_by_default(out_dir, tmp_path):
    (tmp_path / "run.json").write_text((out_dir / "report.json").read_text())
    proc = _cli("report", str(tmp_path / "run.json"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run.html").read_bytes() == (out_dir / "report.html").read_bytes()


@pytest.mark.parametrize("case, word", [
    ("missing", "cannot read"),
    ("not-json", "invalid JSON"),
    ("wrong-schema", "schema_version"),
    ("bad-recipe", "runs[0].recipe"),
    ("out-dir-missing", "does not exist"),
    ("out-is-a-directory", "is a directory"),
])
def test_report_refuses_bad_input_with_one_line(case, word, tmp_path):
    good = _report(_run("fp32")).to_json()
    path, out = tmp_path / "run.json", tmp_path / "page.html"
    path.write_text({"not-json": "{not json", "wrong-schema": good.replace('"schema_version": 1',
                                                                         '"schema_version": 99'),
                     "bad-recipe": good.replace("params=fp32,compute=fp32", "params=fp17,compute=fp32"),
                     }.get(case, good))
    if case == "missing":
        path.unlink()
    if case == "out-dir-missing":
        out = tmp_path / "no" / "such" / "page.html"
    if case == "out-is-a-directory":
        out = tmp_path
    proc = _cli("report", str(path), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mixprec: error: ") and word in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "page.html").exists()


def test_compare_out_that_is_a_file_is_refused_before_training(tmp_path):
    target = tmp_path / "taken"
    target.write_text("something else\n")
    proc = _cli("compare", "--steps", "1", "--out", str(target))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a file" in lines[0], proc.stderr
    assert target.read_text() == "something else\n"


def test_tiny_losses_keep_their_digits_in_the_table():
    from mixprec.lab.report import _loss_text
    # beam's MSE is ~1e-9 m^2: four decimals would print every recipe as 0.0000.
    assert _loss_text(1.019e-9) == "1.019e-09"
    assert _loss_text(0.0315) == "0.0315" and _loss_text(0.0) == "0.0000"
    assert _loss_text(float("nan")) == "nan"

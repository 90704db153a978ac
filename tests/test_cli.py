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
from mixprec.lab.compare.render import render_notes, render_table
from mixprec.lab.compare.report import CompareReport
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
    assert report_json["schema_version"] == CompareReport.SCHEMA.version
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
    (["compare", "--steps", "1", "--parallel", "fsdp"], "--parallel fsdp needs --nproc N"),
    (["compare", "--steps", "1", "--threads", "9999"], "more than the"),         # ran at 3 samples/s
    (["compare", "--steps", "99999999999999999999"], "at most 1,000,000"),        # was accepted
    (["doctor", "--steps", "1000001"], "at most 1,000,000"),
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
    ("doctor-report", "is a doctor report"),
    ("inspect-report", "is an inspect report"),
    ("out-dir-missing", "does not exist"),
    ("out-is-a-directory", "is a directory"),
])
def test_report_refuses_bad_input_with_one_line(case, word, tmp_path):
    good = _report(_run("fp32")).to_json()
    path, out = tmp_path / "run.json", tmp_path / "page.html"
    path.write_text({"not-json": "{not json", "wrong-schema": good.replace('"schema_version": 1',
                                                                         '"schema_version": 99'),
                     "bad-recipe": good.replace("params=fp32,compute=fp32", "params=fp17,compute=fp32"),
                     "doctor-report": '{"schema_version": 1, "kind": "doctor", "workload": "mlp"}',
                     "inspect-report": '{"schema_version": 1, "kind": "inspect", "workload": "mlp"}',
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
    from mixprec.lab.compare.render import _loss_text
    # beam's MSE is ~1e-9 m^2: four decimals would print every recipe as 0.0000.
    assert _loss_text(1.019e-9) == "1.019e-09"
    assert _loss_text(0.0315) == "0.0315" and _loss_text(0.0) == "0.0000"
    assert _loss_text(float("nan")) == "nan"


def test_tables_print_every_value_in_full_when_piped(tmp_path):
    """Issue 15: in a pipe rich assumed 80 columns and printed 'spe...', '1.0...', '1.67772e+...'."""
    long = "params=fp16,compute=fp16,master=fp32,scale=dynamic(hysteresis=2,growth_interval=1000)"
    runs = [_run("fp32"), _run(long, recipe=long, final_scale=2.0**24, samples_per_s=123456.0)]
    path = tmp_path / "wide.json"
    path.write_text(_report(*runs).to_json())
    proc = _cli("report", str(path), "--out", str(tmp_path / "wide.html"))
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout and "..." not in proc.stdout
    assert "16777216" in proc.stdout and "speed" in proc.stdout and "123,456" in proc.stdout
    assert f"custom-1: {long}" in proc.stdout


BUGGY = '''
import torch
import torch.nn.functional as F
from torch import nn
from mixprec.lab.workloads import Split


def shapes():
    x, y = torch.randn(200, 16), torch.randint(0, 3, (200,))
    return {"model": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(8, 3)),   # 32 != 8
            "data": Split(x[:160], y[:160], x[160:], y[160:]), "loss": F.cross_entropy,
            "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}
'''


@pytest.mark.parametrize("command", ["compare", "doctor"])
def test_a_bug_in_the_users_model_is_one_line_with_traceback_on_request(tmp_path, command, monkeypatch,
                                                                       capsys):
    from mixprec.lab.cli import main
    (tmp_path / "buggy_workload.py").write_text(BUGGY)
    monkeypatch.syspath_prepend(str(tmp_path))            # in-process: an interpreter start costs seconds
    monkeypatch.delenv("MIXPREC_TRACEBACK", raising=False)
    args = [command, "--workload", "buggy_workload:shapes", "--steps", "2", "--device", "cpu"] + (
        ["--recipes", "fp32"] if command == "compare" else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("mixprec: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert "buggy_workload:shapes: RuntimeError" in line and "module Linear" in line, line
    assert "F.linear" in line and "--traceback" in line, line
    with pytest.raises(RuntimeError, match="cannot be multiplied"):    # the whole traceback on request
        main(args + ["--traceback"])
    monkeypatch.setenv("MIXPREC_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        main(args)


@pytest.mark.parametrize("command, option, target, words", [
    ("compare", "--json", "afile/x.json", ["afile is a file, not a directory"]),
    ("compare", "--out", "afile/run", ["afile is a file, not a directory"]),
    ("doctor", "--json", "afile/sub/x.json", ["afile is a file, not a directory"]),
    ("doctor", "--out", "afile", ["doctor.json and doctor.html"]),
])
def test_path_errors_name_the_real_problem(tmp_path, command, option, target, words, capsys):
    from mixprec.lab.cli import main
    (tmp_path / "afile").write_text("keep\n")
    assert main([command, "--steps", "1", "--device", "cpu", option, str(tmp_path / target)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert all(w in lines[0] for w in words) and "mkdir -p" not in lines[0], lines[0]
    assert (tmp_path / "afile").read_text() == "keep\n"


def test_a_run_that_skipped_every_step_is_marked_failed_in_table_notes_and_page():
    """Issue 15: compare printed 'loss nan, test acc 36.0%, skips 10' for a run that never stepped."""
    import io

    from rich.console import Console

    from mixprec.lab.compare.html import render_html
    dead = _run("bf16", recipe="params=fp32,compute=bf16,master=none,scale=none", skipped_steps=3,
                skipped_at=(0, 1, 2), final_loss=math.nan, test_metric=0.36)
    report = _report(_run("fp32"), dead)
    buf = io.StringIO()
    Console(file=buf, width=200).print(render_table(report))
    bf16_row = next(line for line in buf.getvalue().splitlines() if line.strip().startswith("bf16"))
    assert "failed" in bf16_row and "36.0%" not in bf16_row and "nan" not in bf16_row
    fp32_row = next(line for line in buf.getvalue().splitlines() if line.strip().startswith("fp32"))
    assert "failed" not in fp32_row                       # one skip of three is a result
    (note,) = [n for n in render_notes(report) if "FAILED" in n]
    assert note.startswith("bf16 FAILED: all 3 steps were skipped") and "trace_nonfinite=True" in note
    page = render_html(report)
    assert "bf16 FAILED: all 3 steps" in page and "<td class=\"right\">failed</td>" in page


def test_memory_is_counted_on_the_first_step_taken_not_a_skipped_one():
    """Issue 15: a skipped first step had no AdamW state yet: 203 kB 0.52x against fp16's 357 kB."""
    from mixprec.lab.trainer import train
    from mixprec.lab.workloads import get_workload
    mlp = get_workload("mlp")
    normal = train(mlp, "fp16", steps=20)
    overflow = train(mlp, "fp16,scale=dynamic(init=2**24)", steps=20)   # too large: step 0 overflows
    assert normal.skipped_at == () and overflow.skipped_at[:1] == (0,) and overflow.skipped_steps < 20
    assert overflow.memory.optimizer == normal.memory.optimizer > 0
    assert overflow.memory == normal.memory


def test_ctrl_c_keeps_the_recipes_that_finished(tmp_path, monkeypatch, capsys):
    """Issue 15: Ctrl-C threw away recipes that had already finished."""
    import mixprec.lab.compare.run
    from mixprec.lab.cli import main
    real_steps, calls = mixprec.lab.compare.run.train_steps, []

    def steps_then_interrupt(*args, **kwargs):
        calls.append(1)
        run = real_steps(*args, **kwargs)
        if len(calls) != 2:
            return run

        def second():
            next(run)                        # its first turn (of 1 step: 20 steps / 20 turns)
            yield
            raise KeyboardInterrupt          # Ctrl-C during its second turn
        return second()
    monkeypatch.setattr(mixprec.lab.compare.run, "train_steps", steps_then_interrupt)
    rc = main(["compare", "--recipes", "fp32,bf16,fp16", "--steps", "20", "--device", "cpu",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 130 and "kept the 2 recipe(s) that had taken steps" in captured.err
    report = CompareReport.from_json((tmp_path / "report.json").read_text())
    # Turns of 1 step: fp32 had taken 2 when bf16 was interrupted in its second turn, fp16 1.
    assert report.partial and [r.label for r in report.runs] == ["fp32", "fp16"]
    assert [len(r.losses) for r in report.runs] == [2, 1] and [r.eval_steps[-1] for r in report.runs] == [2, 1]
    assert "PARTIAL: interrupted after 1-2 of 20 steps" in captured.out
    assert "PARTIAL: interrupted" in captured.out
    assert "PARTIAL: interrupted" in (tmp_path / "report.html").read_text()


def test_reports_without_the_partial_field_still_read():
    data = json.loads(_report(_run("fp32")).to_json())
    assert data.pop("partial") is False
    assert CompareReport.from_json(json.dumps(data)) == _report(_run("fp32"))


def test_slow_steps_report_progress_by_time_not_only_every_ten_steps():
    """Issue 15: compare --benchmark gpt2 on a CPU printed nothing for 90 s (ten slow steps)."""
    from mixprec.lab.trainer import train
    from mixprec.lab.workloads import get_workload
    seen = []
    train(get_workload("mlp"), "fp32", steps=4, on_progress=lambda p: seen.append(p.step), progress_s=0.0)
    assert seen == [0, 1, 2, 3, 4]
    seen.clear()
    train(get_workload("mlp"), "fp32", steps=4, on_progress=lambda p: seen.append(p.step), progress_s=1e9)
    assert seen == [0, 4]


def test_recipe_words_let_a_named_recipe_be_tweaked_on_the_command_line():
    from mixprec.lab.cli_args import recipe_words as _recipe_words
    from mixprec.recipe import parse_recipe
    words = _recipe_words(["fp32,fp16,scale=static:1024", "fp8-delayed,fp8=delayed(margin=1)",
                           "fp32,params=bf16,compute=bf16,rounding=stochastic"])
    assert words == ["fp32", "fp16,scale=static:1024", "fp8-delayed,fp8=delayed(margin=1)", "fp32",
                     "params=bf16,compute=bf16,rounding=stochastic"]
    assert [parse_recipe(w).label for w in words][-1] == "bf16-sr"
    assert str(parse_recipe(words[2])).endswith("compute=bf16,master=none,scale=none,fp8=delayed(margin=1)")
    # Every key that is not params/compute/master edits the recipe before it, the memory keys too.
    assert _recipe_words(["fp32,bf16,saved=exact,bf16-sr,moments=bf16-sr"]) == [
        "fp32", "bf16,saved=exact", "bf16-sr,moments=bf16-sr"]


NAN_WORKLOAD = '''
import torch, torch.nn.functional as F
from torch import nn
from mixprec.lab.workloads import Split

class NanModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
    def forward(self, x):
        return self.fc(x) * float("nan")      # every loss and gradient is NaN, under every recipe

def nan_model():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 4, generator=g), torch.randint(0, 2, (80,), generator=g)
    return {"model": NanModel, "data": Split(x[:64], y[:64], x[64:], y[64:]), "loss": F.cross_entropy,
            "optimizer": lambda p: torch.optim.SGD(p, lr=0.1), "batch_size": 16}
'''


def test_a_compare_in_which_every_recipe_failed_exits_1(tmp_path, monkeypatch, capsys):
    # Was exit 0 with every run marked FAILED: a script could not tell it from a result.
    from mixprec.lab.cli import main
    (tmp_path / "nan_workload.py").write_text(NAN_WORKLOAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["compare", "--workload", "nan_workload:nan_model", "--steps", "3", "--device", "cpu",
            "--threads", "1", "--json", str(tmp_path / "r.json")]
    assert main(args + ["--recipes", "fp16,fp32"]) == 1
    captured = capsys.readouterr()
    assert "fp16 FAILED" in captured.out and "fp32 FAILED" in captured.out     # the table and notes still print
    assert captured.err.strip().splitlines()[-1].startswith("mixprec: error: every recipe failed: all 3 steps")
    assert (tmp_path / "r.json").exists()                                      # and the report is written


def test_a_gpu_benchmark_on_the_cpu_says_it_will_be_slow_before_it_starts(monkeypatch, capsys):
    # compare --workload gpt2 --device cpu --steps 1 printed nothing for 300 s.
    from mixprec.lab.cli import main
    from mixprec.lab.compare import cli as compare_cli

    def interrupted(plan, console):
        raise KeyboardInterrupt       # stop before the first step: only what is printed before it counts
    monkeypatch.setattr(compare_cli, "_run_with_progress", interrupted)
    assert main(["compare", "--benchmark", "gpt2", "--device", "cpu", "--steps", "1", "--recipes", "fp32,bf16"]) == 130
    err = capsys.readouterr().err
    assert "mixprec: note: gpt2 is a benchmark sized for GPUs: on the CPU one step can take minutes" in err
    assert "(2 recipe(s) x 1 step(s))" in err
    assert main(["compare", "--workload", "mlp", "--device", "cpu", "--steps", "1"]) == 130
    assert "note" not in capsys.readouterr().err          # the built-in CPU workloads take seconds


@pytest.mark.parametrize("command, recipe_flag", [("compare", "--recipes"), ("doctor", "--recipe"),
                                                  ("trace", "--recipe")])
@pytest.mark.parametrize("recipe, named", [("fp16-pure,fp32_modules=LayerNrom", "fp32_modules=LayerNrom"),
                                           ("fp8,fp8=current(skip=nomatch)", "fp8 skip='nomatch'")])
def test_a_recipe_name_that_matches_no_module_is_a_usage_error_before_training(command, recipe_flag, recipe,
                                                                               named, capsys):
    # Were found by the engine once the recipe's run had started (compare: after the recipes before it
    # had trained), and printed as a crash: "... in (casting/model.py:103: raise ValueError(); run with --traceback".
    from mixprec.lab.cli import main
    assert main([command, recipe_flag, recipe, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mixprec: error: {named} matches no") and "--traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["compare", "doctor", "trace"])
def test_a_seed_past_64_bits_is_a_usage_error_before_training(command, capsys):
    # torch.Generator().manual_seed(2**70) failed inside the run: "Overflow when unpacking long long".
    from mixprec.lab.cli import main
    assert main([command, "--seed", str(2**64), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"mixprec: error: seed must be a non-negative integer below 2**64 (what "
                           f"torch.manual_seed takes), got {2**64}"), err


def test_mixprecs_own_error_while_a_workload_runs_is_its_message_without_the_raise_line():
    from mixprec import MixedPrecision
    from mixprec.lab.failure import describe_failure
    from torch import nn
    import torch
    model = nn.Linear(3, 2)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
    try:
        mp.backward(model(torch.ones(4, 3)).sum(1))     # a loss that is not one number: the user's mistake
    except ValueError as e:
        line = describe_failure(e, "mine:tiny")
    assert line.startswith("mine:tiny: ValueError: the loss must be a single number, got shape (4,): reduce it")
    assert "raise ValueError" not in line and "engine.py" not in line, line
    try:
        model(torch.ones(4, 5))                          # torch's own error keeps where it happened
    except RuntimeError as e:
        line = describe_failure(e, "mine:tiny")
    assert "module Linear" in line and "F.linear" in line, line


def test_cli_shows_python_warnings_as_its_own_one_line_notes(capsys):
    """Issue 37: the CLI printed raw warnings (`.../lab/trainer.py:181: Fp8EmulationWarning: ...` and then
    the source line `mp = MixedPrecision(...)`); the library, used from Python, must keep warning normally."""
    import warnings
    import torch
    from torch import nn
    import mixprec
    from mixprec.lab.cli import main
    shown_before = warnings.showwarning
    # cnn's only linear is its (10, 32) head: fp8 swaps nothing and the engine warns (a real warning).
    assert main(["trace", "--workload", "cnn", "--recipe", "fp8", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("mixprec: note: ")]
    assert len(notes) == 1 and "swapped no layer to fp8" in notes[0] and notes[0].endswith("(UserWarning)")
    assert err.strip() == notes[0]                      # no path, no source line, nothing else
    assert ".py:" not in err and "MixedPrecision(" not in err
    assert warnings.showwarning is shown_before         # the CLI gave Python's printer back
    model = nn.Sequential(nn.Linear(32, 10))
    with pytest.warns(UserWarning, match="swapped no layer to fp8"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")


def test_ctrl_c_while_the_page_renders_still_writes_report_table_and_page(tmp_path, monkeypatch, capsys):
    """Issue 37: a Ctrl-C after every recipe finished, while the page rendered, left only report.json
    (no table, no page) and exited 130. A real SIGINT is sent from inside the page's renderer."""
    import os
    import signal
    import mixprec.lab.compare.html
    from mixprec.lab.cli import main
    real_render = mixprec.lab.compare.html.render_html

    def render_after_ctrl_c(report):
        os.kill(os.getpid(), signal.SIGINT)     # delivered to the main thread before the next bytecode
        return real_render(report)
    monkeypatch.setattr(mixprec.lab.compare.html, "render_html", render_after_ctrl_c)
    handler_before = signal.getsignal(signal.SIGINT)
    rc = main(["compare", "--recipes", "fp32,bf16", "--steps", "2", "--device", "cpu", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 130 and "after all 2 recipe(s) finished" in captured.err
    report = CompareReport.from_json((tmp_path / "report.json").read_text())
    assert not report.partial and [r.label for r in report.runs] == ["fp32", "bf16"]   # every recipe ran
    page = (tmp_path / "report.html").read_text()
    assert page.rstrip().endswith("</html>") and "PARTIAL" not in page
    assert "fp32" in captured.out and "bf16" in captured.out and "PARTIAL" not in captured.out   # the table
    assert signal.getsignal(signal.SIGINT) is handler_before       # Ctrl-C works as before afterwards


def test_compare_interleaves_recipes_so_load_from_other_work_hits_all_alike():
    """Issue 37: under load the speed column inverted (fp16 "1.66x faster" than fp32 on a CPU), because the
    recipes ran one after another and the load changed between them. Here the machine is 'busy' (each
    step sleeps 10 ms) for the first half of all the steps the compare takes, idle after: one recipe after
    another, the first would measure about 10x slower than the second; taking turns, each gets half."""
    import time
    from mixprec.lab.compare.run import plan_compare, run_compare
    from mixprec.lab.trainer import train
    from mixprec.lab.workloads import get_workload
    mlp, calls = get_workload("mlp"), []

    def loss_on_a_busy_machine(out, y):
        calls.append(1)
        if len(calls) <= 40:                  # the first 40 of the 2 x 40 training steps
            time.sleep(0.010)
        return mlp.loss_fn(out, y)
    busy = dataclasses.replace(mlp, loss_fn=loss_on_a_busy_machine)
    # fp32 twice under two spellings (scale=none is fp32's own): the same work, so the ratio should be 1.
    plan = plan_compare(busy, ["fp32", "fp32,fp32_modules=LayerNorm"], steps=40, device="cpu", eval_every=40)
    report = run_compare(plan)
    assert report.turn_steps == 2 and len(calls) == 80
    a, b = (r.samples_per_s for r in report.runs)
    assert 0.6 < a / b < 1.6, (a, b)          # one after another: about 10 (0.26 s against 0.03 s)
    assert render_table(report).caption == "samples/s: measured in turns of 2 steps, all recipes alike"
    # Each run's own losses are unchanged by the turns: the same as training it alone.
    alone = train(mlp, "fp32", steps=40, eval_every=40)
    assert report.runs[0].losses == alone.losses and report.runs[0].test_metric == alone.test_metric


def test_comparing_one_recipe_named_twice_is_refused():
    from mixprec.lab.compare.run import unique_recipes
    with pytest.raises(ValueError, match=r"are one recipe, .* named 2 times: name different ones, e.g. fp32 bf16"):
        unique_recipes(["fp32", "fp32"], "compare")
    assert len(unique_recipes(["fp32", "bf16", "fp32"], "compare")) == 2      # repeats among others: run once
    assert len(unique_recipes(["bf16"], "compare")) == 1

"""``mixprec plan``: the speed model's numbers by hand, the choice on given evidence, a plan that trains
exactly as verified, and every bad input as one clear error."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from mixprec.diagnostics.speed_model import TARGETS, LinearShape, Target, get_target, linear_cost
from mixprec.lab.cli import main
from mixprec.lab.plan import plan_setup, run_plan
from mixprec.lab.plan.candidates import PlanLayer
from mixprec.lab.plan.choose import LayerEvidence, choose, raise_most_sensitive, recipe_for
from mixprec.lab.plan.evidence import WorkloadDiverges
from mixprec.lab.plan.render import plan_lines
from mixprec.lab.plan.report import PlanReport
from mixprec.lab.trainer import train
from mixprec.lab.user_workloads import load_user_workload
from mixprec.recipe import parse_recipe

TESTS = Path(__file__).parent
# A target whose memory is free: every GEMM is compute-bound, so the tiny test models plan as large
# ones would (fp8 and fp4 pay). Blackwell's kernels and peaks; Hopper's for the contrast.
FREE_B = dataclasses.replace(TARGETS["b200"], name="free-b200", hbm_tb_s=1e9)
FREE_H = dataclasses.replace(TARGETS["h100"], name="free-h100", hbm_tb_s=1e9)


@pytest.fixture
def workload(monkeypatch):
    monkeypatch.chdir(TESTS)
    return lambda name: load_user_workload(f"plan_workloads:{name}")


# ------------------------------------------------------------------------------ the speed model
def test_a_large_gemm_is_compute_bound_and_fp8_halves_it_on_h100():
    h100 = get_target("h100")
    s = LinearShape("big", 4096, 4096, 4096)
    flops = 2 * 4096 ** 3                                       # one GEMM
    bf16 = linear_cost(h100, s, "bf16")
    assert bf16.gemm_s == pytest.approx(3 * flops / 989.4e12)  # compute-bound: 3 GEMMs at the bf16 peak
    assert bf16.cast_s == pytest.approx(4096 * 4096 * 6 / 3.35e12)   # fp32 weight read, bf16 written
    cur = linear_cost(h100, s, "current")
    assert cur.gemm_s == pytest.approx(3 * flops / 1978.9e12)
    e = 4096 * 4096                                             # elements of x, W and g alike
    # read x, g (bf16) and W (fp32), twice (the amax pass), and write each twice in 1 byte
    assert cur.cast_s == pytest.approx(((2 + 4 + 2) * e * 2 + 2 * 3 * e) / 3.35e12)
    row = linear_cost(h100, s, "rowwise")
    assert row.gemm_s == pytest.approx(3 * flops / (1978.9e12 * 0.9))
    assert row.seconds < cur.seconds < bf16.seconds


def test_a_thin_gemm_is_memory_bound_and_casts_make_fp8_slower():
    h100 = get_target("h100")
    s = LinearShape("thin", 2048, 64, 64)
    bf16 = linear_cost(h100, s, "bf16")
    # forward: x (M,K) and W (N,K) read, y written, all bf16; the weight gradient written in fp32
    fwd = (2048 * 64 + 64 * 64) * 2 + 2048 * 64 * 2
    wgrad = (2048 * 64 + 2048 * 64) * 2 + 64 * 64 * 4
    assert bf16.gemm_s == pytest.approx((2 * fwd + wgrad) / 3.35e12)
    assert linear_cost(h100, s, "rowwise").seconds > bf16.seconds


def test_targets_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match=r"unknown target 'h10'.*did you mean 'h100'.*h100, h200, b200"):
        get_target("h10")
    with pytest.raises(ValueError, match="h100 has no tensor-core kernel for nvfp4"):
        linear_cost(get_target("h100"), LinearShape("a", 64, 64, 64), "nvfp4")
    b200 = linear_cost(get_target("b200"), LinearShape("a", 8192, 8192, 8192), "nvfp4")
    assert b200.gemm_s == pytest.approx(3 * 2 * 8192 ** 3 / 9000e12)


# ----------------------------------------------------------------------------- the choice
def _layer(name, costs):
    from mixprec.diagnostics.speed_model import LinearCost
    return PlanLayer(name, LinearShape(name, 1, 1, 1), tuple(costs), {},
                     {f: LinearCost(f, c, 0.0, 0.0) for f, c in costs.items()})


def test_choose_takes_the_fastest_passing_format_and_says_why_not_the_others():
    layers = (_layer("a", {"bf16": 1.0, "current": 0.5, "nvfp4": 0.3}),
              _layer("b", {"bf16": 2.0, "current": 1.0, "nvfp4": 0.6}),
              _layer("c", {"bf16": 1.0, "current": 1.2}))
    ev = {"a": {"current": LayerEvidence("current", 30, 28, 0.0), "nvfp4": LayerEvidence("nvfp4", 18, 25, 0.0)},
          "b": {"current": LayerEvidence("current", 30, 28, 0.0), "nvfp4": LayerEvidence("nvfp4", 22, 21, 0.0)},
          "c": {"current": LayerEvidence("current", 30, 28, 0.0)}}
    picks = choose(layers, ev, floor_db=20)
    assert {n: p.format for n, p in picks.items()} == {"b": "nvfp4", "a": "current", "c": "bf16"}
    assert "predicted slower (1.20x" in picks["c"].why
    assert list(picks) == ["b", "a", "c"]                      # most costly first
    # The most sensitive low layer (b: nvfp4 at 21 dB) goes one step up: to current, more accurate there.
    raised, banned, what = raise_most_sensitive(layers, ev, picks, 20, frozenset(), 1)
    assert raised["b"].format == "current" and what == ["b: nvfp4 -> current"] and ("b", "nvfp4") in banned
    recipe = recipe_for(raised)
    assert parse_recipe(str(recipe)) == recipe
    assert str(recipe.fp8) == "current(skip=c)"
    nothing = choose(layers, ev, floor_db=40)
    assert all(p.format == "bf16" for p in nothing.values())
    assert "SQNR 28.0 dB, 12.0 dB under the 40 dB floor" in nothing["a"].why


# ----------------------------------------------------------------------------- whole plans
def test_a_plan_mixes_formats_where_evidence_differs_and_trains_exactly_as_verified(workload):
    # At a 16.4 dB floor nvfp4 (16.2-16.6 dB on these layers) passes on some layers and not on others.
    w = workload("tiny")
    report = run_plan(plan_setup(w, target=FREE_B, steps=8, seed=3, floor_db=16.4))
    assert report.accepted and report.verified is not None
    formats = [lay.format for lay in report.layers]
    assert "nvfp4" in formats and len(set(formats)) >= 2 and "layers=" in report.recipe
    # Every low layer's evidence passes the floor, and nvfp4 is kept off where it does not.
    for lay in report.layers:
        if lay.format != "bf16":
            assert lay.evidence[lay.format].passes
        if "nvfp4" in lay.evidence and not lay.evidence["nvfp4"].passes:
            assert lay.format != "nvfp4"
    # The recipe trains in the lab's trainer bit for bit as it was verified: same seed, same losses.
    assert train(w, report.recipe, steps=report.steps, seed=report.seed).losses == report.verified.losses
    assert PlanReport.from_json(report.to_json()) == report


def test_where_one_format_everywhere_leaves_the_band_the_plan_keeps_the_failing_layers_higher(workload):
    # tiny over 40 steps from seed 0: nvfp4 on every layer ends ~7 bands above bf16. At an 18 dB floor
    # its evidence fails layer 0 (16.9 dB) and passes the others, whose verification then leaves the band
    # too: the plan raises them until it comes inside, and the contrast run shows what it avoided.
    report = run_plan(plan_setup(workload("tiny"), target=FREE_B, steps=40, seed=0, floor_db=18,
                                 contrast="nvfp4"))
    contrast = report.contrast
    assert contrast.format == "nvfp4" and "fp8=nvfp4" in contrast.recipe and len(contrast.losses) == 40
    assert not contrast.inside and contrast.gap > 2 * report.band.band
    assert report.accepted and report.verified.gap <= report.band.band
    assert any(lay.evidence["nvfp4"].passes for lay in report.layers)         # nvfp4 was tried somewhere
    assert all(lay.format != "nvfp4" for lay in report.layers if not lay.evidence["nvfp4"].passes)
    assert not report.attempts[0].inside and any("nvfp4 ->" in r for a in report.attempts for r in a.raised)
    assert any("contrast, nvfp4 on every planned layer" in line and "OUTSIDE" in line for line in plan_lines(report))
    assert PlanReport.from_json(report.to_json()) == report
    # A file written before the contrast existed reads with none.
    old = json.loads(report.to_json())
    del old["contrast"]
    assert PlanReport.from_json(json.dumps(old)).contrast is None


def test_where_fp8_does_not_pay_the_plan_is_bf16_and_says_so_without_claiming_a_verification(workload):
    # tiny's GEMMs are memory-bound on a real H100: every format passes its evidence, none is faster.
    report = run_plan(plan_setup(workload("tiny"), target="h100", steps=8, contrast="rowwise"))
    assert report.accepted and all(lay.format == "bf16" and "predicted slower" in lay.why for lay in report.layers)
    lines = plan_lines(report)
    assert "try 1: every layer bf16, the reference itself (nothing to verify)" in lines
    assert not any(line.startswith("verification") for line in lines)
    assert report.contrast.format == "rowwise" and len(report.contrast.losses) == 8     # trained: not the plan's


def test_hopper_has_no_fp4_so_the_same_model_plans_differently_and_says_why(workload):
    setup_h = plan_setup(workload("tiny"), target=FREE_H, steps=8)
    assert all(lay.excluded["nvfp4"] == "no nvfp4 kernel on free-h100" for lay in setup_h.layers)
    assert all("nvfp4" in lay.candidates for lay in plan_setup(workload("tiny"), target=FREE_B, steps=8).layers)


def test_bad_inputs_are_one_clear_error(workload):
    with pytest.raises(ValueError, match="has no linear layer the plan can put in low precision"):
        plan_setup(workload("nowhere"), target="h100", steps=8)
    with pytest.raises(WorkloadDiverges, match="diverges in fp32|does not learn in fp32"):
        run_plan(plan_setup(workload("diverges"), target="h100", steps=8))
    with pytest.raises(ValueError, match="--steps must be at least 8"):
        plan_setup(workload("tiny"), steps=4)
    with pytest.raises(ValueError, match=r"--contrast must be one low-precision format \(current, .*got 'fp4'"):
        plan_setup(workload("tiny"), steps=8, contrast="fp4")
    with pytest.raises(ValueError, match="--contrast nvfp4: h100 has no nvfp4 kernel.*one of current, rowwise, block"):
        plan_setup(workload("tiny"), steps=8, contrast="nvfp4")
    with pytest.raises(ValueError, match=r"--contrast block: no planned layer can take it \(0: weight \(64, 32\)"):
        plan_setup(workload("tiny"), target=FREE_H, steps=8, contrast="block")


@pytest.mark.slow       # a whole plan's evidence: ~5 s unloaded, 16 s on the loaded 2-core CPU
def test_a_budget_nothing_meets_names_the_layers_and_by_how_much(workload):
    report = run_plan(plan_setup(workload("tiny"), target=FREE_B, steps=8, floor_db=200))
    assert not report.accepted and report.recipe == ""
    assert any("dB under the 200 dB floor" in line for line in report.failing)
    assert len(report.failing) == len(report.layers)


@pytest.mark.slow       # ~20 s on a loaded 2-core CPU: up to three verifications
def test_a_band_nothing_meets_raises_layers_then_refuses(workload):
    # A budget of a millionth of fp32's band: every low-precision try is outside; each retry raises
    # the most sensitive layer one step; what is left is bf16, which the report refuses to call a plan.
    report = run_plan(plan_setup(workload("tiny"), target=FREE_B, steps=8, seed=3, budget=1e-6, retries=2))
    assert not report.accepted and len(report.attempts) >= 2
    assert not report.attempts[0].inside and report.attempts[1].raised
    assert any("gap" in line for line in report.failing)


def test_cli_errors_exit_2(workload, capsys):
    assert main(["plan", "--target", "x100"]) == 2
    assert "unknown target 'x100'" in capsys.readouterr().err
    assert main(["plan", "--workload", "plan_workloads:nowhere", "--steps", "8"]) == 2
    assert "nothing to plan" in capsys.readouterr().err
    assert main(["plan", "--workload", "plan_workloads:diverges", "--steps", "8"]) == 2
    assert "in fp32" in capsys.readouterr().err
    assert main(["plan", "--workload", "plan_workloads:tiny", "--steps", "8", "--contrast", "nvfp4"]) == 2
    assert "h100 has no nvfp4 kernel" in capsys.readouterr().err


@pytest.mark.slow       # a whole plan through the command line: ~10 s on a loaded 2-core CPU
def test_cli_plan_writes_its_report_page_and_recipe(workload, capsys, tmp_path):
    assert main(["plan", "--workload", "plan_workloads:tiny", "--steps", "8", "--target", "b200",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    report = PlanReport.from_json((tmp_path / "plan.json").read_text())
    assert out.strip().splitlines()[-1] == report.recipe and "predicted on b200" in out
    assert "<img" in (tmp_path / "plan.html").read_text()
    assert math.isfinite(report.step_ratio)


def test_gradient_snr_separates_fp4_from_fp8_end_to_end(workload):
    from mixprec.lab.plan.evidence import GRAD_SNR_THRESHOLD, gradient_snr
    w = workload("tiny")
    torch.manual_seed(0)
    weights = w.build_model().state_dict()
    names = ["0", "2", "4"]
    fp8 = gradient_snr(w, weights, "rowwise", step=0, seed=0, steps=8, device=torch.device("cpu"), layers=names)
    fp4 = gradient_snr(w, weights, "nvfp4", step=0, seed=0, steps=8, device=torch.device("cpu"), layers=names)
    assert set(fp8) == set(fp4) == set(names)
    # e4m3 keeps ~3.5 significant bits more than e2m1: the fp8 gradient is many times closer to fp32's.
    assert all(fp8[n] > 4 * fp4[n] for n in names) and min(fp8.values()) > 10 * GRAD_SNR_THRESHOLD


@pytest.mark.slow       # five short trainings of a tiny model: ~10 s on a loaded 2-core CPU
def test_plan_model_plans_a_users_own_model():
    from torch import nn
    from mixprec.lab.plan import plan_model
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    y = (x @ torch.randn(32, 16, generator=g)).tanh()
    report = plan_model(lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)),
                        lambda params: torch.optim.AdamW(params, lr=1e-3), x, y, torch.nn.functional.mse_loss,
                        target=FREE_H, batch_size=64, steps=8)
    assert report.accepted and [lay.name for lay in report.layers] == ["0", "2"]
    assert all(lay.format in ("current", "rowwise", "block") for lay in report.layers)
    assert all(lay.excluded["nvfp4"] == "no nvfp4 kernel on free-h100" for lay in report.layers)


@pytest.mark.slow       # plans and times a tiny Llama: ~1 min on a loaded 2-core CPU
def test_the_gpu_benchmark_of_a_plan_runs_its_whole_path_on_the_cpu():
    import subprocess
    import sys
    script = TESTS.parent / "benchmarks" / "plan" / "plan_e2e.py"
    out = subprocess.run([sys.executable, str(script), "--cpu-smoke"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "plan for h100 over 8 steps" in out.stdout and "accepted" in out.stdout
    assert "speed model error (predicted / measured - 1)" in out.stdout
    for name in ("amp-bf16", "bf16", "fp8", "plan"):
        assert f"  {name:<10} compiled" in out.stdout

"""The beam workload's claim: fp16 without loss scaling loses accuracy to gradient underflow, the
dynamic scale recovers fp32's, and the doctor sees it coming from the gradient histograms."""

import pytest
import torch

from mixprec.lab.doctor.run import plan_doctor, run_doctor
from mixprec.lab.trainer import train
from mixprec.lab.workloads import get_workload

STEPS = 100     # fp16 without a scale has stalled by step 80 (R^2 ~0.978; fp32 goes on to ~0.999)


@pytest.fixture(scope="module")
def runs():
    beam = get_workload("beam")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {r: train(beam, r, steps=STEPS, seed=0, eval_every=STEPS)
                for r in ("fp32", "params=fp32,compute=fp16,scale=none", "fp16")}
    finally:
        torch.set_num_threads(saved)


def test_fp16_without_a_loss_scale_loses_accuracy_and_dynamic_scaling_recovers_it(runs):
    fp32, unscaled, dynamic = (runs[r].test_metric for r in runs)
    assert fp32 > 0.99
    # The unexplained variance (1 - R^2) is several times fp32's: the fit stalled.
    assert 1 - unscaled > 4 * (1 - fp32), (fp32, unscaled)
    assert dynamic == pytest.approx(fp32, abs=1e-3)
    assert runs["fp16"].skipped_steps == 0


def test_the_doctor_predicts_it_from_the_histograms():
    report = run_doctor(plan_doctor("beam", "fp16", steps=3, device="cpu"))
    # Most gradient values sit below fp16's smallest subnormal in true units...
    assert report.window.below_floor_unscaled > 0.5
    # ...so the window starts far above 1, and the run's dynamic 2**16 lies inside it.
    assert report.window.low >= 10 and report.window.fits
    assert report.window.low <= 16 <= report.window.high
    head = report.modules[-1]
    assert head.name == "2" and head.stats["activation_grads"].fraction("fp16", "flush") > 0.3


def test_without_a_loss_scale_the_doctor_sees_the_flush_as_zeros():
    from mixprec.lab.doctor.render import render_findings
    report = run_doctor(plan_doctor("beam", "params=fp32,compute=fp16,scale=none", steps=3, device="cpu"))
    hidden = report.modules[0].gradients()
    assert hidden.zeros == hidden.count                   # flushed in backward: nothing reached layer 0
    findings = " ".join(render_findings(report))
    assert "modules '0', '1' was exactly zero" in findings and "fp16's flush" in findings
    assert "does not scale the loss" in findings

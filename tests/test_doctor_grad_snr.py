"""The doctor's end-to-end gradient SNR (lab/doctor/grad_snr.py, issue 35): hand-worked values, exactness
against fp32 itself, the order of the formats, the user's state untouched, and the advice it changes."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import warnings

import pytest
import torch
from torch import nn

from mixprec.lab.cli import main
from mixprec.lab.doctor.grad_snr import SNR_FLOOR, GradSnr, gradient_snr, snr_and_sign, with_grad_snr
from mixprec.lab.doctor.render_what_if import grad_snr_line, what_if_lines
from mixprec.lab.doctor.report import DoctorReport
from mixprec.lab.doctor.run import plan_doctor, run_doctor
from mixprec.lab.doctor.what_if_report import FormatWhatIf, LayerWhatIf, WhatIfOptions, WhatIfReport


def test_snr_and_sign_hand_worked():
    ref = torch.tensor([3.0, 4.0])                                   # |ref| = 5
    assert snr_and_sign(ref, ref).tolist() == [math.inf, 1.0]
    assert snr_and_sign(ref, torch.zeros(2)).tolist() == [1.0, 0.0]  # all signal lost: SNR exactly 1
    # test - ref = (0, -8): SNR 5/8; only the first entry (weight |3| of 7) keeps its sign
    snr, sign = snr_and_sign(ref, torch.tensor([3.0, -4.0])).tolist()
    assert snr == 0.625 and sign == pytest.approx(3 / 7, abs=1e-15)
    assert SNR_FLOOR == math.sqrt(3) and GradSnr(1.7, 1.0).below_floor and not GradSnr(math.nan, 1.0).below_floor


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def test_gradient_snr_exact_against_itself_ordered_across_formats_and_leaves_state_alone():
    torch.manual_seed(0)
    model = _model()
    x, y = torch.randn(64, 32), torch.randn(64, 16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    layers = ["0", "2", "4"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # "emulated on cpu" notices
        snr = gradient_snr(_model, model.state_dict(),
                           lambda m: nn.functional.mse_loss(m(x).float(), y), ["fp32", "bf16", "fp8-rowwise", "nvfp4"],
                           layers=layers)
    assert set(snr) == set(layers)
    for name in layers:
        s = snr[name]
        assert s["fp32"].snr == math.inf and s["fp32"].sign == 1.0     # the same computation: identical
        # bf16 rounds operands to 8 bits, e4m3 to 4, e2m1 to 2: each costs more of the gradient
        assert s["bf16"].snr > s["fp8-rowwise"].snr > s["nvfp4"].snr > 1.0
        assert 0.9 < s["nvfp4"].sign <= s["fp8-rowwise"].sign <= 1.0
    assert torch.equal(torch.get_rng_state(), rng)                       # the caller's random state
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="layers"):
        gradient_snr(_model, state, lambda m: m(x).sum(), ["bf16"], layers=[])


def _report(snr: float) -> WhatIfReport:
    r = FormatWhatIf(format="fp8", bits=8.0, sqnr_out_db=30.0, sqnr_grad_w_db=30.0,
                     counts={"input": (0, 0, 4), "weight": (0, 0, 4), "grad_output": (0, 0, 4)})
    layer = LayerWhatIf(name="fc", type="Linear", in_features=2, out_features=2, rows=2, rows_total=2,
                        formats=(r,))
    return with_grad_snr(WhatIfReport(floor_db=20.0, max_rows=128, step=1, seconds=0.0, layers=(layer,)),
                         {"fc": {"fp8": GradSnr(snr, 0.9)}})


def test_a_format_below_sqrt3_is_not_advised_and_the_lines_say_why():
    ok, bad = _report(2.0), _report(1.5)
    assert ok.layers[0].formats[0].grad_snr == 2.0 and ok.advice(ok.layers[0]) == "fp8"
    assert bad.advice(bad.layers[0]) == "bf16"                      # 30 dB locally, but 1.5 end to end
    line = grad_snr_line(bad)
    assert "fp8 1.5 (fc), below sqrt(3) in 1 layer(s)" in line
    unmeasured = dataclasses.replace(bad, layers=(dataclasses.replace(bad.layers[0], formats=(
        dataclasses.replace(bad.layers[0].formats[0], grad_snr=math.nan, grad_sign=math.nan),)),))
    assert unmeasured.advice(unmeasured.layers[0]) == "fp8" and grad_snr_line(unmeasured) is None


def test_doctor_what_if_reports_it_per_layer_and_round_trips():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_doctor(plan_doctor("mlp", "bf16", steps=2, device="cpu", what_if=WhatIfOptions()))
        off = run_doctor(plan_doctor("mlp", "bf16", steps=2, device="cpu", what_if=WhatIfOptions(grad_snr=False)))
    for layer in report.what_if.layers:
        snrs = {r.format: r.grad_snr for r in layer.formats}
        assert all(math.isfinite(v) and v > 1.0 for v in snrs.values())
        assert snrs["mxfp8"] > snrs["nvfp4"]
    assert all(math.isnan(r.grad_snr) for layer in off.what_if.layers for r in layer.formats)
    assert any(line.startswith("what-if, end-to-end gradient SNR") for line in what_if_lines(report))
    assert DoctorReport.from_json(report.to_json()).what_if.layers[0].formats[0].grad_snr == \
        report.what_if.layers[0].formats[0].grad_snr


def test_cli_can_leave_it_out(tmp_path):
    with contextlib.redirect_stdout(io.StringIO()) as buf:
        rc = main(["doctor", "--workload", "mlp", "--steps", "1", "--device", "cpu", "--threads", "1",
                   "--what-if-no-grad-snr", "--out", str(tmp_path)])
    assert rc == 0 and "end-to-end gradient SNR" not in buf.getvalue()
    w = DoctorReport.from_json((tmp_path / "doctor.json").read_text()).what_if
    assert w is not None and all(math.isnan(r.grad_snr) for layer in w.layers for r in layer.formats)


"""``mixprec doctor --what-if``: per linear layer and fp8/fp4 format, flush and saturation shares, SQNR of
output and weight gradient against bf16, and the cheapest tolerated format."""

import contextlib
import dataclasses
import io
import json
import math
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from mixprec.fp8 import Fp8Config, Fp8Linear
from mixprec.fp8.blocked_linear import blocked_recipe
from mixprec.fp8.blockscale import fake_quantize_blocked, quantize_blocked
from mixprec.lab.cli import main
from mixprec.lab.doctor.render_what_if import (
    model_formats,
    render_what_if_table,
    what_if_lines,
)
from mixprec.lab.doctor.report import DoctorReport
from mixprec.lab.doctor.run import plan_doctor
from mixprec.lab.doctor.what_if import (
    WhatIfCapture,
    format_bits,
    layer_what_if,
    measure_what_if,
    sqnr_db,
)
from mixprec.lab.doctor.what_if_report import FORMATS, WhatIfOptions, WhatIfReport
from mixprec.recipe import RECIPES

OUTLIER = 1e5      # channel 0 of the second layer's input: 2**16.6 above the rest, past e4m3's 2**14.8 normals


class ChannelGain(nn.Module):
    """Multiplies channel 0 by OUTLIER: an activation outlier channel (as LayerNorm gains make them)."""

    def forward(self, h):
        gain = torch.ones(h.shape[-1], dtype=h.dtype)
        gain[0] = OUTLIER
        return h * gain


def _outlier_model():
    """Linear(64, 512) fed Gaussian data, then the outlier channel, then Linear(512, 16) whose weights on
    that channel are OUTLIER times smaller, so the outlier carries as much of the output as any channel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), ChannelGain(), nn.Linear(512, 16))
    with torch.no_grad():
        model[2].weight[:, 0] /= OUTLIER
    return model


def _captured(model, floor_db=20.0, max_rows=4096, rows=512):
    torch.manual_seed(1)
    x, target = torch.randn(rows, 64), torch.randn(rows, 16)
    capture = WhatIfCapture(model, max_rows=max_rows)
    with capture.capturing():
        (model(x) * target).sum().backward()         # g of the last layer: the target, N(0, 1)
    return measure_what_if(capture, WhatIfOptions(floor_db=floor_db, max_rows=max_rows), step=1)


@pytest.fixture(scope="module")
def outlier_report() -> WhatIfReport:
    return _captured(_outlier_model())


@pytest.fixture(scope="module")
def base_report() -> DoctorReport:
    """A real doctor report (mlp, 2 steps, written before the what-if existed) to carry one."""
    return DoctorReport.from_json((Path(__file__).parent / "data" / "doctor-v1.json").read_text())


# ------------------------------------------------------------------------------ the hand-made model
def test_outlier_channel_hurts_per_tensor_fp8_far_more_than_blocks(outlier_report):
    plain, outlier = outlier_report.layers
    assert (plain.name, outlier.name) == ("0", "2") and outlier.in_features == 512
    db = {f: outlier.result(f).sqnr_out_db for f in FORMATS}
    # Per tensor, every value of x but the outlier channel lands in e4m3's subnormals or flushes; one
    # scale per row cannot help (every row holds the channel); 128-, 32- and 16-blocks confine it.
    assert db["fp8"] < 10 and db["fp8-rowwise"] > db["fp8"] + 5
    assert db["fp8-block"] > db["fp8"] + 12 and db["mxfp8"] > db["fp8"] + 12
    assert outlier.result("fp8").flushed("input") > 0.3 and outlier.result("mxfp8").flushed("input") < 0.1
    # The weight gradient contracts over rows: the outlier channel holds nearly all of grad_W's energy
    # there, and the fp8 formats render it as well as on the plain layer.
    assert all(outlier.result(f).sqnr_grad_w_db > 24 for f in FORMATS[:4])
    # The well-behaved layer: every fp8 format near the e4m3 x e4m3 level, per tensor as good as blocks.
    assert all(27 < plain.result(f).sqnr_out_db < 33 for f in FORMATS[:4])
    assert abs(plain.result("fp8").sqnr_out_db - plain.result("fp8-block").sqnr_out_db) < 1
    # nvfp4: its e4m3 block scales, 2**-9 at the smallest, cannot reach blocks 2**16 below the outlier's:
    # they round coarsely and values overflow e2m1's max.
    assert outlier.result("nvfp4").saturated("input") > 0 == plain.result("nvfp4").saturated()


def test_advice_is_the_cheapest_tolerated_format(outlier_report, base_report):
    plain, outlier = outlier_report.layers
    assert outlier_report.advice(plain) == "fp8"            # 8 bits: the cheapest above 20 dB
    # The outlier layer: per tensor and rowwise fall below 20 dB; of the two that clear it, the cheaper.
    ok = [f for f in ("fp8-block", "mxfp8") if outlier.result(f).tolerated(20.0)]
    assert ok and outlier_report.advice(outlier) == min(ok, key=lambda f: format_bits(f, 512, 16))
    assert not outlier.result("fp8").tolerated(20.0) and not outlier.result("fp8-rowwise").tolerated(20.0)
    # A 10 dB floor admits nvfp4 on the plain layer, never on the layer where nvfp4 saturates.
    assert plain.cheapest(10.0).format == "nvfp4"
    assert outlier.cheapest(10.0).format != "nvfp4"
    # Nothing tolerated: bf16, and the lines say why each format failed.
    low = WhatIfReport(floor_db=60.0, max_rows=4096, step=1, seconds=0.0, layers=outlier_report.layers)
    assert low.advice(plain) == "bf16"
    report = dataclasses.replace(base_report, what_if=low)
    text = "\n".join(what_if_lines(report))
    assert "'2': bf16: no format is tolerated" in text and "saturates" in text and "output SQNR" in text


def test_bits_order_formats_as_their_storage():
    bits = {f: format_bits(f, 1024, 1024) for f in FORMATS}
    assert bits["nvfp4"] == pytest.approx((4.5 + 4 + 8 / 256 + 4.5) / 3)
    assert bits["fp8"] == 8 and bits["mxfp8"] == 8.25
    assert bits["fp8-rowwise"] == pytest.approx(8 + 32 / 1024)
    assert bits["fp8-block"] == pytest.approx((8.25 + 8 + 32 / 128**2 + 8.25) / 3)
    assert sorted(FORMATS, key=bits.get) == ["nvfp4", "fp8", "fp8-rowwise", "fp8-block", "mxfp8"]
    assert format_bits("mxfp8", 64, 16) == pytest.approx((8.25 * 2 + 8 + 8 / 16) / 3)   # 16-wide g rows


# ------------------------------------------------------------------- against independent references
def _e4m3_count(t: np.ndarray, fmt_max: float, dtype) -> tuple[int, int, int]:
    """Per-tensor current scaling counted with ml_dtypes: (flushed nonzero, saturated, total)."""
    t = t.astype(np.float32)
    scale = np.float32(fmt_max) / np.float32(np.abs(t).max())
    y = t * scale
    q = y.astype(dtype).astype(np.float64)
    return int(((y != 0) & (q == 0)).sum()), int((np.abs(y) > fmt_max).sum()), t.size


def _blocked_count(t: torch.Tensor, how, elem_dtype, overflows) -> tuple[int, int, int]:
    """Blocked counts: the decodes from quantize_blocked, x / decode rounded by ml_dtypes."""
    _, decode = quantize_blocked(t, how, 1)
    t0, t1 = how.tile(1)
    d = np.repeat(np.repeat(decode.numpy().astype(np.float32), t0, 0), t1, 1)[:t.shape[0], :t.shape[1]]
    with np.errstate(divide="ignore"):
        y = np.where(d == 0, 0.0, t.numpy() / d).astype(np.float32)      # a 0 decode flushes its block
    q = y.astype(elem_dtype).astype(np.float64)
    return int(((t.numpy() != 0) & (q == 0)).sum()), int(overflows(np.abs(y)).sum()), t.numel()


def test_flush_and_saturation_counts_equal_ml_dtypes():
    torch.manual_seed(3)
    x = torch.randn(48, 64) * torch.logspace(-6, 0, 64)         # columns spanning 6 decades
    x[5, 7] = 3e4                                                 # and one outlier
    # nvfp4: a 16-block whose e4m3 code, 448 * 0.17 / 3e4 = 1.3 * 2**-9, rounds down to 2**-9 (a subnormal):
    # its values land at 0.17 / (2**-9 * 3e4 / (6 * 448)) = 7.8 > 6 and saturate.
    x[0, 32:48] = 0.17
    w, g = torch.randn(32, 64) * 1e-3, torch.randn(48, 32) * torch.logspace(-8, 0, 32)
    layer = layer_what_if(x, w, g)
    pt = layer.result("fp8").counts
    assert pt["input"] == _e4m3_count(x.numpy(), 448.0, ml_dtypes.float8_e4m3fn)
    assert pt["weight"] == _e4m3_count(w.numpy(), 448.0, ml_dtypes.float8_e4m3fn)
    assert pt["grad_output"] == _e4m3_count(g.numpy(), 57344.0, ml_dtypes.float8_e5m2)
    assert pt["input"][0] > 100              # the check has something to count
    nv = blocked_recipe(Fp8Config.parse("nvfp4"))
    # e2m1: |y| >= 7 rounds past 6 (the tie goes up: 6's last mantissa bit is odd); e4m3: |y| > 464.
    for role, t in (("input", x), ("weight", w), ("grad_output", g)):
        assert layer.result("nvfp4").counts[role] == _blocked_count(t, nv.role(role), ml_dtypes.float4_e2m1fn,
                                                                    lambda a: a >= 7)
    assert layer.result("nvfp4").counts["input"][1] > 0 and layer.result("nvfp4").counts["input"][0] > 100
    mx = blocked_recipe(Fp8Config.parse("mxfp8"))
    assert layer.result("mxfp8").counts["input"] == _blocked_count(x, mx.input, ml_dtypes.float8_e4m3fn,
                                                                   lambda a: a > 464)


def _sqnr64(ref: np.ndarray, test: np.ndarray) -> float:
    return 10 * math.log10((ref**2).sum() / ((ref - test) ** 2).sum())


def _bf16(t: np.ndarray) -> np.ndarray:
    return t.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _per_tensor64(t: np.ndarray, fmt_max: float, dtype) -> np.ndarray:
    t = t.astype(np.float32)
    scale = np.float32(fmt_max) / np.float32(np.abs(t).max())
    return (t * scale).astype(dtype).astype(np.float64) / np.float64(scale)


def test_sqnr_equals_a_float64_computation():
    torch.manual_seed(4)
    x, w, g = torch.randn(256, 96), torch.randn(40, 96) / 10, torch.randn(256, 40) * 1e-4
    layer = layer_what_if(x, w, g)
    xn, wn, gn = x.numpy(), w.numpy(), g.numpy()
    y_ref, gw_ref = _bf16(xn) @ _bf16(wn).T, _bf16(gn).T @ _bf16(xn)
    # Per tensor: ml_dtypes e4m3 for x and W, e5m2 for g, each with its own current scale.
    xq, wq = _per_tensor64(xn, 448.0, ml_dtypes.float8_e4m3fn), _per_tensor64(wn, 448.0, ml_dtypes.float8_e4m3fn)
    gq = _per_tensor64(gn, 57344.0, ml_dtypes.float8_e5m2)
    fp8 = layer.result("fp8")
    assert fp8.sqnr_out_db == pytest.approx(_sqnr64(y_ref, xq @ wq.T), abs=1e-3)
    assert fp8.sqnr_grad_w_db == pytest.approx(_sqnr64(gw_ref, gq.T @ xq), abs=1e-3)
    # mxfp8: the dequantized operands blocked along each GEMM's contraction axis, products in float64.
    how = blocked_recipe(Fp8Config.parse("mxfp8"))
    fq = lambda t, role, axis: fake_quantize_blocked(t, how.role(role), axis).double().numpy()
    mx = layer.result("mxfp8")
    assert mx.sqnr_out_db == pytest.approx(_sqnr64(y_ref, fq(x, "input", 1) @ fq(w, "weight", 1).T), abs=1e-3)
    assert mx.sqnr_grad_w_db == pytest.approx(
        _sqnr64(gw_ref, fq(g, "grad_output", 0).T @ fq(x, "input", 0)), abs=1e-3)
    assert 20 < fp8.sqnr_grad_w_db < mx.sqnr_grad_w_db          # e5m2 gradients cost per-tensor ~4 dB


def test_sqnr_edge_cases():
    a = torch.arange(1.0, 65.0).reshape(8, 8)
    assert sqnr_db(a, a).item() == math.inf and sqnr_db(torch.zeros(3), torch.zeros(3)).item() == math.inf
    # error = a / 8 exactly (small integers times 1.125 are exact in fp32): 20 log10(8) dB
    assert sqnr_db(a, a * 1.125).item() == pytest.approx(20 * math.log10(8), abs=1e-12)
    bad = a.clone()
    bad[0, 0] = math.inf
    assert math.isnan(sqnr_db(bad, a).item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_what_if_matches_the_recipes_own_layer(fmt):
    """Each format's SQNRs are those the recipe's Fp8Linear gives (emulated) on the same x, W, g:
    the same blocks, scales, nvfp4 stochastic rounding noise and Hadamard signs for a layer of that name."""
    torch.manual_seed(5)
    linear = nn.Linear(96, 48, bias=False)
    # Wide ranges across rows and columns, so that a block laid along the wrong axis (or a missing
    # Hadamard transform) changes the numbers, even for power-of-two scales.
    x = torch.randn(160, 96) * torch.logspace(-3, 0, 96) * torch.logspace(0, -3, 160)[:, None]
    g = torch.randn(160, 48) * torch.logspace(-3, 0, 48) * torch.logspace(-3, 0, 160)[:, None]
    layer = Fp8Linear.from_linear(linear, RECIPES[fmt].fp8, "emulate")
    layer.reseed(zlib.crc32(b"blocks.3.fc"))                       # what swap_to_fp8 does for this name
    xr = x.clone().requires_grad_(True)
    out = layer(xr)
    out.backward(g)
    xb, wb = x.bfloat16().float(), linear.weight.detach().bfloat16().float()
    want_out, want_gw = sqnr_db(xb @ wb.t(), out.detach()).item(), sqnr_db(g.bfloat16().float().t() @ xb,
                                                                            linear.weight.grad).item()
    got = layer_what_if(x, linear.weight.detach(), g, name="blocks.3.fc").result(fmt)
    assert got.sqnr_out_db == pytest.approx(want_out, abs=1e-3)
    assert got.sqnr_grad_w_db == pytest.approx(want_gw, abs=1e-3)


# ---------------------------------------------------------------------------------------- capture
def test_capture_measures_first_call_in_true_units_row_cap_and_conv1d():
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(6)
    conv = Conv1D(24, 32)                 # (in 32, out 24), weight stored (in, out)
    model = nn.Sequential(conv, nn.ReLU(), nn.Linear(24, 8))
    x = torch.randn(3, 100, 32)           # 300 rows
    capture = WhatIfCapture(model, max_rows=128, inverse_scale=lambda: torch.tensor(0.25))
    with capture.capturing():
        (model(x) * 8).sum().backward()   # as if the loss were scaled by 4: g = 8, 2 in true units
        model(x)                          # a second call is not measured again
    report = measure_what_if(capture)
    assert [layer.name for layer in report.layers] == ["0", "2"] and report.layers[0].type == "Conv1D"
    assert [(layer.rows, layer.rows_total) for layer in report.subsampled] == [(128, 300)] * 2
    # What it measured: the first 128 rows of each input, W as (out, in), g in true units.
    conv_out = conv(x).detach().requires_grad_(True)
    (model[2](torch.relu(conv_out)) * 8).sum().backward()
    with torch.no_grad():
        h = torch.relu(conv(x)).reshape(-1, 24)[:128]
        want_lin = layer_what_if(h, model[2].weight, torch.full((128, 8), 2.0), name="2")
        want_conv = layer_what_if(x.reshape(-1, 32)[:128], conv.weight.t(),
                                  conv_out.grad.reshape(-1, 24)[:128] * 0.25, name="0")
    assert report.layers[1].formats == want_lin.formats
    assert report.layers[0].formats == want_conv.formats       # a Conv1D is the nn.Linear holding W^T


def test_bad_options_say_what_to_fix():
    with pytest.raises(ValueError, match="--what-if-floor must be a finite number"):
        WhatIfOptions(floor_db=math.nan)
    with pytest.raises(ValueError, match="--what-if-rows must be an integer >= 128"):
        WhatIfOptions(max_rows=100)
    with pytest.raises(ValueError, match=r"--what-if-floor must be a finite number of dB >= 0.*got -5"):
        WhatIfOptions(floor_db=-5)      # issue 33: accepted, every format passed
    assert WhatIfOptions(floor_db=0).floor_db == 0
    with pytest.raises(ValueError, match="x \\(M, K\\), w \\(N, K\\) and g \\(M, N\\)"):
        layer_what_if(torch.zeros(4, 3), torch.zeros(2, 4), torch.zeros(4, 2))
    with pytest.raises(TypeError, match="WhatIfOptions"):
        plan_doctor("mlp", "fp32", device="cpu", what_if=True)


# --------------------------------------------------------------------------- report, CLI, page
def test_json_round_trip_and_older_files(outlier_report, base_report):
    report = dataclasses.replace(base_report, what_if=outlier_report)
    text = report.to_json()
    assert DoctorReport.from_json(text) == report
    data = json.loads(text)
    assert [layer["advice"] for layer in data["what_if"]["layers"]] == [
        outlier_report.advice(layer) for layer in outlier_report.layers]        # written for readers
    assert data["what_if"]["layers"][0]["formats"][0]["counts"]["input"][2] == 512 * 64
    old = (Path(__file__).parent / "data" / "doctor-v1.json").read_text()     # written before the what-if
    assert "what_if" not in json.loads(old) and DoctorReport.from_json(old).what_if is None


def test_cli_what_if_end_to_end_on_mlp(tmp_path):
    buf = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = main(["doctor", "--workload", "mlp", "--steps", "2", "--device", "cpu", "--threads", "1",
                   "--what-if-floor", "18", "--out", str(tmp_path)])
    seconds = time.perf_counter() - start
    assert rc == 0
    out = buf.getvalue()
    report = DoctorReport.from_json((tmp_path / "doctor.json").read_text())
    w = report.what_if
    assert w is not None and w.floor_db == 18 and w.step == 2
    assert [layer.name for layer in w.layers] == ["0", "2"]            # Linear, ReLU, Linear
    assert all(layer.rows == layer.rows_total == 64 for layer in w.layers)
    assert "what-if on step 2's batch" in out and "nvfp4" in out and "advice" in out
    for layer in w.layers:
        assert f"- what-if {layer.name!r}: {w.advice(layer)}" in out
    assert "whole model" in out
    assert "end-to-end gradient SNR" in out                             # grad_snr.py, on by default
    assert all(r.grad_snr > 1 for layer in w.layers for r in layer.formats)
    page = (tmp_path / "doctor.html").read_text()
    assert 'id="what-if"' in page and 'id="plot-what-if"' in page and 'href="#what-if"' in page
    assert page.count("data:image/png;base64,", page.index('id="what-if"')) >= 1
    assert 'id="what-if-table"' in page
    assert seconds < 60                   # seconds on a quiet CPU; generous for a loaded one


def test_cli_rejects_bad_what_if_values(capsys):
    assert main(["doctor", "--workload", "mlp", "--what-if-rows", "5"]) == 2     # before anything trains
    assert "--what-if-rows must be an integer >= 128" in capsys.readouterr().err


def test_table_and_whole_model_line(outlier_report, base_report):
    report = dataclasses.replace(base_report, what_if=outlier_report)
    table = render_what_if_table(report)
    # Cheapest first, by the mean over the layers of their bits per element (16-wide g rows make
    # rowwise and 1x128 blocks dearer than mxfp8's 32-blocks here).
    assert [c.header for c in table.columns] == ["layer", "nvfp4", "fp8", "mxfp8", "fp8-block", "fp8-rowwise",
                                                 "advice"]
    everyone, most = model_formats(outlier_report)
    assert everyone == outlier_report.advice(outlier_report.layers[1]) == "mxfp8"   # the outlier layer decides
    assert most == ("fp8", ("2",))        # fp8 per tensor: all but the outlier layer
    lines = what_if_lines(report)
    assert lines[0].startswith("what-if: a layer tolerates a format when") and "20 dB" in lines[0]


# ------------------------------------------------------------------ layers the fp8 swap cannot take
def _odd_report(model, k):
    torch.manual_seed(1)
    x = torch.randn(256, k)
    capture = WhatIfCapture(model, max_rows=4096)
    with capture.capturing():
        model(x).square().sum().backward()
    return measure_what_if(capture, WhatIfOptions(grad_snr=False), step=1)


def test_no_recipe_is_advised_for_a_model_whose_layers_the_fp8_swap_cannot_take(base_report):
    # Odd dims: the what-if measures them (fp8 tolerated: Gaussian data), but --recipe fp8 would swap
    # nothing (weight dims must be multiples of 16), so the whole-model line must not advise it.
    torch.manual_seed(0)
    w = _odd_report(nn.Sequential(nn.Linear(33, 7), nn.ReLU(), nn.Linear(7, 5)), 33)
    assert [layer.swappable for layer in w.layers] == [False, False]
    assert w.layers[0].result("fp8").tolerated(w.floor_db)          # measured fine, cannot be swapped
    assert model_formats(w) == (None, None)
    lines = what_if_lines(dataclasses.replace(base_report, what_if=w))
    assert not any("--recipe" in line for line in lines), lines
    assert "no fp8 recipe can take any of its 2 measured layer(s)" in lines[-1]
    assert "'0' (7, 33): pad to (16, 48)" in lines[-1] and "'2' (5, 7): pad to (16, 16)" in lines[-1]
    assert "but no fp8 recipe can take this layer" in next(line for line in lines if "what-if '0'" in line)
    # The swap agrees: it takes neither layer, for the reason the what-if gives.
    from mixprec.fp8.swap import swap_to_fp8
    from mixprec.fp8.swap_report import Fp8Reason
    swap = swap_to_fp8(nn.Sequential(nn.Linear(33, 7), nn.ReLU(), nn.Linear(7, 5)), Fp8Config(),
                       backend="emulate")
    assert [d.reason for d in swap.layers] == [Fp8Reason.SHAPE, Fp8Reason.SHAPE]


def test_a_mixed_model_is_advised_on_the_layers_the_swap_can_take(base_report):
    torch.manual_seed(0)
    w = _odd_report(nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 5)), 32)
    assert [layer.swappable for layer in w.layers] == [True, False]
    everyone, _ = model_formats(w)
    assert everyone is not None and w.layers[0].result(everyone).tolerated(w.floor_db)
    line = what_if_lines(dataclasses.replace(base_report, what_if=w))[-1]
    assert line.startswith(f"what-if, whole model: every layer the fp8 swap can take (1) tolerates {everyone}")
    assert "1 layer(s) stay in the base precision under any fp8 recipe" in line and "'2' (5, 48)" in line

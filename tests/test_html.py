"""render_html on synthetic reports: every plot there and a valid PNG, the table, escaping, determinism.

The reports are built by hand with every field set, so each case (skipped steps, a diverged run, a
custom recipe, a CUDA peak, a label with markup in it) is exercised without training anything.
"""

import base64
import html
import dataclasses
import math
import re
import struct

import pytest

from mixprec.diagnostics.memory import MemoryBreakdown
from mixprec.lab.compare.html import _loss_plot, render_html
from mixprec.lab.compare.render import short_names
from mixprec.lab.compare.report import CompareReport
from mixprec.recipe import get_recipe
from mixprec.lab.trainer import RunResult

PLOT_IDS = ["plot-loss", "plot-eval", "plot-scale", "plot-throughput", "plot-memory"]
STEPS = 40
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(name, **changes):
    """A plausible run of ``name`` (a recipe name or string) over STEPS steps, no skips."""
    recipe = get_recipe(name)
    losses = tuple(2.3 * 0.95**i for i in range(STEPS))
    scale = 1.0 if recipe.loss_scale.kind == "none" else 2.0**16
    run = RunResult(recipe=str(recipe), label=recipe.label, final_loss=losses[-1], test_metric=0.9,
                    samples_per_s=1000.0, skipped_steps=0, final_scale=scale, losses=losses,
                    scales=(scale,) * STEPS, skipped_at=(), wall_s=1.5, eval_steps=(10, 20, 30, 40),
                    eval_metrics=(0.5, 0.7, 0.85, 0.9),
                    memory=MemoryBreakdown(params=400, grads=400, optimizer=816, activations=1234))
    return dataclasses.replace(run, **changes)


def _report(*runs, **changes):
    report = CompareReport(workload="mlp", metric="accuracy", device="cpu", device_name="x86_64 CPU",
                           threads=4, torch_version="2.13.0+cpu", mixprec_version="0.1.0", steps=STEPS,
                           batch_size=64, seed=7, runs=runs)
    return dataclasses.replace(report, **changes)


def _fp16_with_skips():
    # Skips at steps 5 and 6 (0-based): the dynamic scale halves twice, 2**16 -> 2**14.
    scales = (2.0**16,) * 5 + (2.0**15, 2.0**14) + (2.0**14,) * (STEPS - 7)
    return _run("fp16", skipped_steps=2, skipped_at=(5, 6), scales=scales, final_scale=2.0**14,
                samples_per_s=1500.0)


def _diverged():
    # fp16-pure's loss goes inf at step 25 (1-based) and NaN after it.
    losses = tuple(2.3 * 0.95**i for i in range(24)) + (math.inf,) + (math.nan,) * (STEPS - 25)
    return _run("fp16-pure", losses=losses, final_loss=math.nan, test_metric=math.nan,
                eval_metrics=(0.5, 0.7, math.nan, math.nan), samples_per_s=math.inf)


def _full_report(**changes):
    custom = "params=bf16,compute=bf16,master=none,scale=none,rounding=stochastic"
    return _report(_run("fp32"), _fp16_with_skips(), _run("bf16"), _diverged(),
                   _run(custom, label=custom, samples_per_s=900.0), **changes)


def _images(page):
    return {fig: base64.b64decode(data) for fig, data in
            re.findall(r'<figure id="([\w-]+)"><img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"',
                       page)}


def _png_size(png):
    # The IHDR chunk comes first after the signature: length, type, then width and height.
    assert png[:8] == PNG_SIGNATURE and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


@pytest.fixture(scope="module")
def page():
    return render_html(_full_report())


# ------------------------------------------------------------------------------------- the page
def test_every_plot_is_a_figure_with_a_caption_and_a_valid_png(page):
    images = _images(page)
    assert list(images) == PLOT_IDS
    for plot_id, png in images.items():
        width, height = _png_size(png)
        assert width > 500 and height > 300, plot_id
        assert png.endswith(b"IEND\xaeB`\x82"), plot_id         # complete: ends with the IEND chunk
    assert page.count("<figcaption>") == len(PLOT_IDS)


def test_the_page_needs_no_network(page):
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page
    assert all(src.startswith("data:image/png;base64,") for src in re.findall(r'src="([^"]*)"', page))


def test_header_names_workload_device_versions_and_the_cpu_caveat(page):
    for text in ["mlp", "x86_64 CPU", "40 x 64", "2.13.0+cpu", "0.1.0", "threads", "seed"]:
        assert text in page, text
    assert "speed on CPU does not predict GPU" in page


def test_the_table_lists_every_recipe_with_the_console_tables_columns(page):
    report = _full_report()
    names = short_names((r.recipe, r.label) for r in report.runs)
    body = re.search(r"<tbody>(.*)</tbody>", page).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", body)
    assert [re.search(r">([^<]*)</td>", row).group(1) for row in rows] == [names[r.recipe]
                                                                           for r in report.runs]
    headers = re.findall(r"<th [^>]*>([^<]*)</th>", page)
    assert headers == ["recipe", "loss", "test acc", "samples/s", "speed", "memory", "mem", "skips",
                       "scale"]
    fp16 = rows[1]
    assert ">1.50x<" in fp16 and ">2<" in fp16 and ">16384<" in fp16      # speed, skips, final scale
    # The custom recipe is custom-1 in the table; a note spells it out, and hovering shows it too.
    assert "custom-1: params=bf16,compute=bf16" in page
    assert 'title="params=bf16,compute=bf16,master=none,scale=none,rounding=stochastic"' in page


def test_labels_are_text_not_markup_nor_math():
    evil = _run("fp32", label="<script>alert('x')</script>&")
    dollars = _run("fp16", label="$x^{2")                     # unbalanced mathtext for matplotlib
    page = render_html(_report(evil, dollars))
    assert "<script" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;" in page
    assert list(_images(page)) == PLOT_IDS


def test_the_same_report_renders_to_the_same_bytes(page):
    assert render_html(_full_report()) == page


def test_a_gpu_language_model_report_shows_tokens_per_second_the_cuda_peak_and_lower_is_better():
    peak = MemoryBreakdown(params=4000, grads=4000, optimizer=8000, activations=2000, peak=30000)
    page = render_html(_report(_run("fp32", memory=peak),
                               _run("fp16", memory=dataclasses.replace(peak, peak=25000)),
                               device="cuda:0", device_name="NVIDIA H100", tokens_per_sample=128,
                               metric="loss", higher_is_better=False))
    assert list(_images(page)) == PLOT_IDS
    assert '<th class="right">tokens/s</th>' in page and ">128,000<" in page   # 1000 samples/s x 128
    assert ">30 kB<" in page and ">0.83x<" in page      # the table shows the peak, as the console does
    assert "lower is better" in page and "black bar" in page
    assert "NVIDIA H100" in page and "speed on CPU" not in page


# --------------------------------------------------------------------------- diverged and empty
def test_a_run_with_nan_and_inf_losses_renders_and_says_where_it_went_non_finite(page):
    assert list(_images(page)) == PLOT_IDS          # the module's report holds the diverged run
    report = _full_report()
    fig = _loss_plot(report.runs, ["fp32", "fp16", "bf16", "fp16-pure", "custom-1"], window=1)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "fp16-pure (non-finite from step 25)" in legend


def test_every_loss_non_finite_still_renders_and_says_so_instead_of_an_empty_axis():
    # Was an empty loss axis (0.96..1.04) that looked like a plot of something.
    dead = _run("fp16", losses=(math.nan,) * STEPS, eval_metrics=(math.nan,) * 4, final_loss=math.nan)
    page = render_html(_report(dead))
    assert list(_images(page)) == [p for p in PLOT_IDS if p != "plot-loss"]
    loss = re.search(r'<figure id="plot-loss">(.*?)</figure>', page).group(1)
    assert "no finite loss to plot" in loss


def _all_skipped(name):
    # Every step skipped for inf/NaN gradients: the weights never moved; the metric is the initial model's.
    return _run(name, losses=(math.nan,) * STEPS, final_loss=math.nan, skipped_steps=STEPS,
                skipped_at=tuple(range(STEPS)), eval_metrics=(0.36,) * 4, test_metric=0.36)


def test_a_page_where_every_run_failed_plots_no_loss_and_no_accuracy():
    # Issue 26: the page drew an empty loss axis and plotted the accuracy of runs it called "not results".
    page = render_html(_report(_all_skipped("fp16"), _all_skipped("fp32")))
    for plot, words in (("plot-loss", "no run trained"), ("plot-eval", "no test accuracy is a result")):
        body = re.search(rf'<figure id="{plot}">(.*?)</figure>', page).group(1)
        assert "<img" not in body and words in body, body
        assert "Left out: fp16, fp32 (every step skipped" in body
        assert "lower panel" not in body and "one point per evaluation" not in body   # no plot to describe


def test_a_failed_run_is_left_out_of_the_loss_and_accuracy_plots_and_keeps_its_colour():
    report = _report(_run("fp32"), _all_skipped("fp16"), _run("bf16"))
    fig = _loss_plot(report.runs, ["fp32", "fp16", "bf16"], window=1, hidden=frozenset({1}))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["fp32", "bf16"]
    colours = [line.get_color() for line in fig.axes[0].get_lines() if line.get_label() in legend]
    assert colours == ["#1f77b4", "#2ca02c"]        # bf16 keeps the third colour, as in the other plots
    page = render_html(report)
    assert list(_images(page)) == PLOT_IDS
    assert "Left out: fp16 (every step skipped" in re.search(r'<figure id="plot-eval">(.*?)</figure>', page).group(1)


def test_no_loss_scaling_anywhere_says_so_instead_of_an_empty_plot():
    page = render_html(_report(_run("fp32"), _run("bf16")))
    scale = re.search(r'<figure id="plot-scale">(.*?)</figure>', page).group(1)
    assert "<img" not in scale and "no loss scaling" in scale
    assert [p for p in PLOT_IDS if p != "plot-scale"] == list(_images(page))


def test_a_report_without_runs_renders():
    page = render_html(_report())
    assert all(f'id="{p}"' in page for p in PLOT_IDS)


# --------------------------------------------------------------- inspect's and trace's pages (issue 37)
def test_inspect_and_trace_out_write_json_and_a_page_rendered_from_it(tmp_path, capsys):
    """README promised that each tool writes its report and a page with --out DIR; inspect and trace
    refused --out ("unrecognized arguments"). Each page holds its console tables cell for cell, renders
    from the JSON alone (the same bytes), and needs no network."""
    from mixprec.lab.cli import main
    from mixprec.lab.inspect.html import render_inspect_html
    from mixprec.lab.inspect.report import InspectReport
    from mixprec.lab.trace.html import render_trace_html
    from mixprec.lab.trace.report import TraceReport
    assert main(["inspect", "--workload", "gpt", "--recipes", "fp32,bf16", "--device", "cpu",
                 "--out", str(tmp_path / "i")]) == 0
    assert main(["trace", "--workload", "gpt", "--recipe", "bf16", "--device", "cpu",
                 "--out", str(tmp_path / "t")]) == 0
    console = capsys.readouterr().out
    inspect = InspectReport.from_json((tmp_path / "i" / "inspect.json").read_text())
    page = (tmp_path / "i" / "inspect.html").read_text()
    assert page == render_inspect_html(inspect)                    # rendered from the report alone
    assert [m.label for m in inspect.memory] == ["fp32", "bf16"]
    rows = re.findall(r"<tr><td class=\"left\">(\w+)</td>", page.split('id="memory-table"')[1].split("</table>")[0])
    assert rows == ["fp32", "bf16"]                                  # memory by role, one row per recipe
    assert 'id="matmul-table"' in page and list(_images(page)) == ["plot-memory"]
    fixes = [line for line in console.splitlines() if line.startswith("fix (")]
    assert fixes and all(f"<li>{html.escape(f)}</li>" in page for f in fixes)   # the padding advice
    trace = TraceReport.from_json((tmp_path / "t" / "trace.json").read_text())
    tpage = (tmp_path / "t" / "trace.html").read_text()
    assert tpage == render_trace_html(trace)
    body = tpage.split('id="trace-table"')[1].split("</table>")[0]
    assert body.count("<tr>") == len(trace.records) + 1              # the header and one row per record
    assert all(f"<td class=\"left\">{r.op}</td>" in body for r in trace.records)
    assert "forward: " in tpage and "backward: " in tpage           # the dtype counts under the table
    for p in (page, tpage):
        assert "http://" not in p and "https://" not in p and "<script" not in p and "<link" not in p


# ------------------------------------------------------------------ many recipes on one page (issue 37)
def test_seven_recipes_keep_their_names_apart_and_their_loss_curves_readable():
    """With 7 recipes the bar charts' names overlapped and the loss panel became a bundle of faint lines."""
    from mixprec.lab.compare.html import _loss_caption, _memory_plot, _throughput_plot
    names = ["fp32", "fp16", "bf16", "fp16-pure", "bf16-pure", "bf16-sr", "tf32"]
    report = _report(*(_run(n) for n in names))
    for fig in (_throughput_plot(report, names, "samples/s"), _memory_plot(report.runs, names)):
        renderer = fig.canvas.get_renderer()
        fig.draw(renderer)                          # lays the figure out as savefig would
        boxes = [t.get_window_extent(renderer) for t in fig.axes[0].get_xticklabels()]
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == names
        assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])), "recipe names overlap"
    fig = _loss_plot(report.runs, names, 11)         # the window of a 500-step run
    faint = [line for line in fig.axes[0].get_lines() if line.get_alpha() is not None and line.get_alpha() < 0.5]
    assert faint == [] and len(fig.axes[0].get_lines()) == len(names)     # averages only, one per recipe
    assert "minibatch's own loss is left out" in _loss_caption(report, 11)
    few = _report(*(_run(n) for n in names[:3]))
    fig = _loss_plot(few.runs, names[:3], 11)
    assert len(fig.axes[0].get_lines()) == 6 and "faint lines are each minibatch's loss" in _loss_caption(few, 11)


def test_the_doctor_page_names_only_the_outlines_it_draws(tmp_path):
    """Issue 37: the doctor page of a bf16 run (no loss scale) named "purple dashes" it never drew."""
    from mixprec.lab.doctor.html import render_doctor_html
    from mixprec.lab.doctor.report import DoctorReport
    from mixprec.lab.cli import main
    assert main(["doctor", "--workload", "mlp", "--recipe", "bf16", "--steps", "2", "--out", str(tmp_path)]) == 0
    report = DoctorReport.from_json((tmp_path / "doctor.json").read_text())
    caption = re.search(r'<figure id="plot-gradients">.*?<figcaption>(.*?)</figcaption>',
                        render_doctor_html(report), re.S).group(1)
    assert not report.scaled and "purple" not in caption
    assert "green outline" in caption       # the recommended scale's outline is drawn for every 16-bit run

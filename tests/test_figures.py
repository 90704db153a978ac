"""The figures README.md and docs/*.md quote are the script's (docs/figures.py), and the exact ones still
come out of the code: a page that says what mixprec no longer does fails here."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
figures = importlib.util.module_from_spec(_spec)
sys.modules["figures"] = figures        # dataclasses look their module up while the class is built
_spec.loader.exec_module(figures)

STORE = figures.load_store()


def test_every_figure_in_the_pages_is_the_script_s():
    assert figures.check(STORE) == []


def test_every_stored_figure_has_a_function_that_makes_it():
    assert set(STORE) <= set(figures.FIGURES)


def test_the_check_names_a_page_that_disagrees_with_the_script(tmp_path):
    # The mechanism itself: a stale number, an unknown name and a block are all caught, with the line.
    page = tmp_path / "page.md"
    page.write_text("intro\nthe CPU fp32 list holds <!-- fig:oplists.cpu.fp32 -->90<!-- /fig --> ops\n"
                    "<!-- fig:no.such -->1<!-- /fig -->\n<!-- fig:block -->```\na\nb\n```<!-- /fig -->\n")
    store = {"oplists.cpu.fp32": {"text": "91"}, "block": {"text": "```\na\nb\n```"}}
    problems = figures.check(store, [page])
    assert len(problems) == 2
    assert problems[0].startswith("page.md:2: figure 'oplists.cpu.fp32' says '90', the script '91'")
    assert problems[1].startswith("page.md:3: figure 'no.such' is not in docs/figures.json")


@pytest.mark.parametrize("name", sorted(n for n, f in figures.FIGURES.items() if f.exact))
def test_exact_figures_still_come_out_of_the_code(name):
    stored = STORE.get(name)
    if stored is None:
        pytest.skip(f"{name} was never generated: run python docs/figures.py --only {name}")
    if stored["torch"] != figures._torch_minor() and not figures.FIGURES[name].any_torch:
        pytest.skip(f"{name} was recorded on torch {stored['torch']}; this is torch {figures._torch_minor()} "
                    "(op lists differ between versions)")
    assert figures.FIGURES[name].make() == stored["text"], (
        f"{name} changed: run python docs/figures.py --only {name}, then read the prose around it")


@pytest.mark.parametrize("table_name", sorted(figures.TABLE_MEMORY))
def test_each_compare_table_shows_its_stored_memory_figure(table_name):
    # The tables are timed (not exact), but their memory column is counted: it must be the exact figure's.
    memory_name, which = figures.TABLE_MEMORY[table_name]
    table = STORE[table_name]["text"].split("$ mixprec ")[1 + which]
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(
        r"^ (\S+) .*?(\d+ [kMG]?B)(?:\s+(\d\.\d\dx))?\s+\d+\s+\S+$", table, re.MULTILINE)}
    assert rows, table
    assert STORE[memory_name]["text"] == ", ".join(
        f"{label} {size}" + ("" if label == "fp32" or ratio is None else f" ({ratio})")
        for label, (size, ratio) in rows.items())


def test_the_stated_tolerances_are_the_ones_the_check_uses():
    page = (ROOT / "docs" / "compare.md").read_text()
    assert f"within {figures.LOSS_TOLERANCE:g} and {figures.ACCURACY_TOLERANCE:g} points" in page


@pytest.mark.slow
def test_the_compare_table_s_losses_and_accuracies_hold_on_this_torch():
    """Issue 37: the exact-figure tests skip off the torch a figure was recorded on, so CI's newest torch
    never checked the README's compare table (bf16's loss reads 0.0313 there, 0.0312 on the page). This reruns
    the table on this torch and holds its loss and accuracy columns to the page's within the stated tolerances
    (timings are not checked; the memory column is counted, and checked exactly above)."""
    stored = STORE["compare.mlp.table"]["text"]
    rows = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(
        r"^ (\S+)\s+(\d+\.\d+)\s+(\d+\.\d)%", stored, re.MULTILINE)}
    assert len(rows) == 4, stored
    _, report = figures._compare(figures.COMPARE_RUNS["mlp"])
    for run in report["runs"]:
        loss, accuracy = rows[run["label"]]
        assert abs(run["final_loss"] - loss) <= figures.LOSS_TOLERANCE + 5e-5, (run["label"], run["final_loss"])
        assert abs(100 * run["test_metric"] - accuracy) <= figures.ACCURACY_TOLERANCE + 0.05, run["label"]

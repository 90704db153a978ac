"""benchmarks/gpu/gpu_check.py: the one-call GPU check cannot rot without a GPU.

The budget logic and the tables built from pytest's and inspect's reports are checked here; the whole
dry run (every part's code path on the CPU at tiny sizes) is slow-marked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import gpu_check  # noqa: E402


def test_tests_table_counts_each_file_and_names_its_first_failure(tmp_path):
    rec = lambda f, t, outcome, s, msg="": json.dumps(dict(file=f, test=t, outcome=outcome, when="call",
                                                           seconds=s, message=msg))
    results = tmp_path / "tests.jsonl"
    results.write_text("\n".join([
        rec("tests/gpu/test_cuda.py", "test_a", "passed", 1.5),
        rec("tests/gpu/test_cuda.py", "TestX::test_b", "failed", 0.5, "boom"),
        rec("tests/gpu/test_cuda.py", "test_c", "failed", 0.25, "later"),
        rec("tests/test_fp8_blocked.py", "test_d", "skipped", 0.1)]) + "\n")
    rows = gpu_check.tests_table(results).splitlines()[2:]
    assert rows == ["| tests/gpu/test_cuda.py | 1 | 2 | 0 | 2.2 | TestX::test_b: boom |",
                    "| tests/test_fp8_blocked.py | 0 | 0 | 1 | 0.1 |  |"]
    assert "stopped before its first result" in gpu_check.tests_table(tmp_path / "missing.jsonl")


def test_the_plugin_stops_a_file_at_its_first_failure_and_records_as_it_goes(tmp_path):
    """A real pytest run through the plugin: the failing file's later tests skip, the other file runs on."""
    (tmp_path / "test_one.py").write_text("def test_a():\n    assert 1 == 2\n\ndef test_b():\n    pass\n")
    (tmp_path / "test_two.py").write_text("def test_c():\n    pass\n")
    results = tmp_path / "out.jsonl"
    env = dict(__import__("os").environ, GPU_CHECK_RESULTS=str(results),
               PYTHONPATH=str(ROOT / "benchmarks" / "gpu"))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
                    "test_one.py", "test_two.py"], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    got = [(r["file"], r["test"], r["outcome"]) for r in map(json.loads, results.read_text().splitlines())]
    assert got == [("test_one.py", "test_a", "failed"), ("test_one.py", "test_b", "skipped"),
                   ("test_two.py", "test_c", "passed")]


def test_memory_table_divides_the_allocators_peak_by_the_prediction(tmp_path):
    report = {"workload": "gpt2", "batch_size": 8, "device": "cuda",
              "memory": [{"label": "bf16", "predicted": {"peak": 2**30}, "measured": {"peak": 1.5 * 2**30}},
                         {"label": "fp8", "predicted": {"peak": 2**20}, "measured": {"peak": None}}]}
    path = tmp_path / "inspect.json"
    path.write_text(json.dumps(report))
    rows = gpu_check.memory_table(path).splitlines()[-2:]
    assert rows == ["| bf16 | 1024.0 | 1536.0 | 1.500 |", "| fp8 | 1.0 | - | - |"]


def test_a_spent_budget_skips_every_part_with_a_line_and_still_writes_the_report(tmp_path):
    assert gpu_check.main(["--budget", "0", "--parts", "tests,host", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu_check.md").read_text()
    assert text.count("skipped: 0 s of the budget left") == 2
    assert "## a. CUDA tests" in text and "## d. The host-bound step" in text


def test_unknown_parts_are_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--parts", "tests,speed"])
    assert "tests, parity, fp8, host, doctor" in capsys.readouterr().err


@pytest.mark.slow
def test_dry_run_runs_every_part_on_the_cpu(tmp_path):
    """Every part's commands exit 0 on the CPU, and the default loop's weights equal torch.amp's."""
    # PY: the interpreter running the tests (gpu_check.sh defaults to python3, the GPU machines' one;
    # on a CI machine that is a bare system Python without torch).
    env = dict(__import__("os").environ, PY=sys.executable)
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                   check=True, timeout=900, capture_output=True, env=env)
    text = (tmp_path / "gpu_check.md").read_text()
    for title in ("a. CUDA tests", "b. The default loop", "c. fp8", "d. The host-bound step", "e. The doctor"):
        assert f"## {title}" in text
    assert "DRY RUN" in text
    for label in ("eager", "compiled", "e2e", "step", "doctor", "memory"):
        assert f"{label} (exit 0)" in text, label
    assert "pytest (exit 0)" in text or "pytest (exit 5)" in text     # every CUDA test skips on a CPU
    parity_rows = [line for line in text.splitlines() if line.startswith("| lm")]
    assert len(parity_rows) == 8 and all(line.endswith("| yes |") for line in parity_rows)


def test_every_script_the_gpu_check_the_session_and_make_run_exists(tmp_path):
    """benchmarks/ is grouped by subject: a command naming a script that moved would fail only on the GPU."""
    argvs = [argv for part in gpu_check.parts(False, tmp_path, "python3") for _, argv, _ in part.commands]
    named = [a for argv in argvs for a in argv if a.endswith(".py")]
    for path in ("benchmarks/gpu/gpu_session.sh", "benchmarks/gpu/gpu_check.sh", "Makefile"):
        named += re.findall(r"benchmarks/[\w/]+\.py", (ROOT / path).read_text())
    assert len(named) > 20
    missing = sorted({p for p in named if not (ROOT / p).is_file()})
    assert not missing, missing

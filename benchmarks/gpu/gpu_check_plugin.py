"""A pytest plugin for benchmarks/gpu/gpu_check.py: stop each test file at its first failure, and record
every test's outcome as it happens.

``pytest -x`` stops the whole run at the first failure; the GPU check wants every file's verdict in
one process (one CUDA start-up), so a failure skips only the rest of its own file, saying why. Each
outcome is appended at once, as one JSON line, to the file named by ``GPU_CHECK_RESULTS`` (and a
failure's first line is printed): a run cut off at its time limit keeps what it saw (the H100 run of
2026-11-27 lost a failure to a JUnit report that is only written at the end).
Loaded with ``-p gpu_check_plugin`` (benchmarks/gpu/ on the path).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_failed_files: set[str] = set()


def _file(nodeid: str) -> str:      # node ids are relative to the root directory, where the check runs pytest
    return nodeid.split("::", 1)[0]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _file(item.nodeid) in _failed_files:
        pytest.skip("an earlier test of this file failed: the GPU check stops a file at its first failure")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # One record per test: its call phase, or the setup/teardown phase that failed or skipped it.
    if report.when != "call" and report.passed:
        return
    message = ""
    if report.failed:
        _failed_files.add(_file(report.nodeid))
        crash = getattr(report.longrepr, "reprcrash", None)
        message = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0][:200]
        print(f"\nFAILED {report.nodeid} ({report.when}): {message}", flush=True)
    path = os.environ.get("GPU_CHECK_RESULTS")
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps({"file": _file(report.nodeid), "test": report.nodeid.split("::", 1)[-1],
                                "outcome": report.outcome, "when": report.when,
                                "seconds": round(report.duration, 3), "message": message}) + "\n")

"""A pytest plugin for benchmarks/gpu_check.py: stop each test file at its first failure.

``pytest -x`` stops the whole run at the first failure; the GPU check wants every file's verdict in
one process (one CUDA start-up), so a failure skips only the rest of its own file, saying why.
Loaded with ``-p gpu_check_plugin`` (benchmarks/ on the path).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_failed_files: set[str] = set()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.path.as_posix() in _failed_files:
        pytest.skip("an earlier test of this file failed: the GPU check stops a file at its first failure")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:     # node ids are relative to the root directory, where the check runs pytest
        _failed_files.add(Path(report.nodeid.split("::", 1)[0]).resolve().as_posix())

"""Every ``>>>`` example in mixprec's docstrings runs and prints what it says (docs that lie are bugs)."""

import doctest
import importlib
import pkgutil

import pytest

import mixprec

MODULES = sorted(info.name for info in pkgutil.walk_packages(mixprec.__path__, "mixprec."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        if not name.startswith("mixprec.integrations."):
            raise
        pytest.skip(f"{name} needs an optional package: {e}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             report=False, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} fail"

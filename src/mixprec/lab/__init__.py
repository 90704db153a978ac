"""The lab: built-in workloads, a trainer that runs them under each recipe, typed reports and the CLI.

Its dependencies are the ``mixprec[lab]`` extra. ``main`` is the ``mixprec`` command: without the
extra it says what to install (one line, exit 2) instead of failing inside an import.

May import: everything in mixprec; nothing outside the lab imports it.
"""

import importlib.util as _util
import sys as _sys

__all__ = ["main"]


def _missing() -> list[str]:
    return [name for name, module in (("rich", "rich"), ("matplotlib", "matplotlib"),
                                      ("scikit-learn", "sklearn")) if _util.find_spec(module) is None]


def main(argv: list[str] | None = None) -> int:
    """The ``mixprec`` command line."""
    missing = _missing()
    if missing:
        print(f"mixprec: the lab needs {', '.join(missing)}: install it with pip install 'mixprec[lab]' "
              "(the library itself, mixprec.MixedPrecision, runs without it)", file=_sys.stderr)
        return 2
    from .cli import main as cli_main
    return cli_main(argv)

"""Strict JSON for the lab's reports: non-finite floats travel as the strings "NaN", "Infinity", "-Infinity".

Python's ``json`` writes NaN and Infinity as bare words by default, which other JSON readers reject;
the reports are read by other tools, so they stay strict and spell those values as strings.

    >>> dumps({"loss": float("nan"), "steps": (1, 2)}, indent=None)
    '{"loss": "NaN", "steps": [1, 2]}'
    >>> decode_float("Infinity")
    inf
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["encode", "dumps", "decode_float"]

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode(value: Any) -> Any:
    """Non-finite floats as strings, tuples as lists, recursively: ready for ``json.dumps(allow_nan=False)``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def dumps(data: Any, indent: int | None = 2) -> str:
    """``data`` as strict JSON text."""
    return json.dumps(encode(data), indent=indent, allow_nan=False)


def decode_float(value: Any) -> float:
    """A number read back from ``dumps``; ValueError for anything that is not one."""
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)

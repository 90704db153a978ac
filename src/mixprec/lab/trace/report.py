"""TraceReport: what ``mixprec trace`` recorded (an ``OpTrace``), with its JSON through the lab's codec.

JSON schema, version 1 (strict JSON)::

    schema_version   int     1 (absent in files written before the lab's codec: still read)
    kind             str     "trace" (likewise)
    recipe           str     the full recipe string
    device           str     where it ran, e.g. "cpu", "cuda:0"
    records          list    one per (module, phase, op, dtypes), in first-run order:
      module         str     qualified module name; "" for the model itself or code outside it (the loss)
      phase          str     "forward" or "backward"
      op             str     aten name with overload, e.g. "addmm", "_softmax"
      inputs         [str]   dtypes of its floating-point tensor inputs ("bf16", "fp32", ...)
      output         str     dtype of its first tensor output ("-" for none)
      count          int     how many times it ran so

``TraceReport.from_json(report.to_json()) == report``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...diagnostics.optrace import OpTrace
from ..codec import JsonReport, Schema

__all__ = ["TraceReport"]


@dataclasses.dataclass(frozen=True)
class TraceReport(JsonReport, OpTrace):
    """An ``OpTrace`` (``select``, ``counts_by_dtype``) that reads and writes the lab's report JSON."""

    # Version 1 files were written untagged, by OpTrace.to_json: a file without tags reads as trace.
    SCHEMA: ClassVar[Schema] = Schema("trace", 1, untagged=True)

    @classmethod
    def of(cls, trace: OpTrace) -> TraceReport:
        return cls(**{f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)})

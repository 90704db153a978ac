"""Observing numbers: what each format would flush or overflow, where memory goes, which matmuls
miss the tensor cores, which op ran in which dtype. Built on the engine; the engine never imports it.

- ``RangeCollector`` (range_collector.py): per-layer exact flush/subnormal/overflow counts of
  activations, gradients, weights and updates, with ``update_lost`` for updates lost to rounding;
  the counting itself is range_histogram.py.
- ``scale_window``: the loss scales that keep gradients inside fp16's range.
- ``memory_report``: bytes per role and saved activations, predicted without allocating the model.
- ``trace_matmuls``: GEMMs whose shapes miss the tensor cores, and the padding that fixes them.
- ``trace_ops``: which aten op ran in which dtype, per module.
- ``NonfiniteTracer``/``NonfiniteOrigin`` (the engine's ``trace_nonfinite=True``) are re-exported
  from ``mixprec.guards.nonfinite``, where the engine hosts them.

May import: the core; never the lab (it observes runs, the lab drives them).
"""

from ..guards.nonfinite import NonfiniteOrigin, NonfiniteTracer
from .memory_report import MemoryReport, memory_report
from .optrace import OpRecord, OpTrace, trace_ops
from .range_collector import RangeCollector, RangesResult, update_lost
from .scale_window import ScaleWindow, scale_window
from .tensor_cores import TensorCoreReport, trace_matmuls

__all__ = [
    "RangeCollector", "RangesResult", "update_lost", "ScaleWindow", "scale_window",
    "MemoryReport", "memory_report", "TensorCoreReport", "trace_matmuls",
    "OpTrace", "OpRecord", "trace_ops", "NonfiniteTracer", "NonfiniteOrigin",
]

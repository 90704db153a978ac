"""CompareReport: the data a ``mixprec compare`` run yields, its JSON form, and its table.

The table (and, later, HTML) is rendered from the report, never scraped from the console.

JSON schema, version 1 (one object; floats that are not finite are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``, so the file is strict JSON that a browser can read)::

    schema_version   int      1; bumped when a field changes meaning or goes away
    kind             str      "compare" (absent in files written before the lab's codec: still read)
    workload         str      the workload's name, e.g. "mlp"
    metric           str      what test_metric measures, e.g. "accuracy" (a fraction in [0, 1])
    device           str      the torch device trained on, e.g. "cpu", "cuda:0"
    device_name      str      the hardware: GPU name, or the CPU's architecture
    threads          int      torch's intra-op CPU threads (speed on CPU depends on it)
    torch_version    str
    mixprec_version  str
    steps            int      optimizer steps per run (skipped ones included)
    batch_size       int
    tokens_per_sample int     tokens in one sample (sequence length) for language models, else 0
    higher_is_better bool     whether a larger test_metric is better (accuracy) or worse (a loss)
    synthetic        bool     random data (a benchmark): the metric only shows the numbers stayed finite
    seed             int      fixes the initial weights and the minibatch order, the same for every run
    partial          bool     the run was interrupted: runs holds the recipes that had taken steps,
                              each with the steps it took (added within version 1: a file without it
                              reads as false)
    turn_steps       int      how speed was measured: the recipes took turns of this many steps, each
                              on its own model, so load on the machine fell on all alike; 0: one recipe
                              after another (--nproc > 1, and files written before it was added)
    runs             list     one object per recipe, in the order run:
      recipe         str      the full recipe string (mixprec.parse_recipe reads it back)
      label          str      the recipe's name, or the full string for a custom recipe
      final_loss     float    mean train loss over the last 10% of steps
      test_metric    float    the workload's metric on its test set
      samples_per_s  float    training throughput, warm-up steps excluded
      skipped_steps  int      steps skipped for an inf/NaN gradient norm (docs/step.md)
      final_scale    float    loss scale after the last step (1.0 without loss scaling)
      losses         [float]  train loss at every step
      scales         [float]  loss scale after every step
      skipped_at     [int]    0-based indices of the skipped steps
      wall_s         float    seconds for the run: build, train, evaluate (the first run also
                              pays torch's one-time lazy imports, about a second)
      eval_steps     [int]    steps after which the test metric was measured (the last step included)
      eval_metrics   [float]  the test metric at each of eval_steps
      memory         object   bytes by role, measured on the first step taken (not skipped):
        params, grads, master, optimizer, activations   int
        peak         int|null the CUDA allocator's peak over the run's own turns, less what the other
                              runs held meanwhile; null on other devices

Reading a report back gives an equal one: ``CompareReport.from_json(report.to_json()) == report``
(the JSON comes from the lab's one codec, ``lab/codec.py``, driven by the dataclasses' fields).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..codec import JsonReport, Schema
from ..trainer import RunResult

__all__ = ["CompareReport"]


@dataclasses.dataclass(frozen=True)
class CompareReport(JsonReport):
    """One workload trained under several recipes on one device, with the same seed and steps."""

    # Version 1 files were written before reports had a "kind": a file without one reads as compare.
    # "partial" came later within version 1 (Ctrl-C keeps the finished recipes): older files lack it.
    SCHEMA: ClassVar[Schema] = Schema("compare", 1, added=frozenset({"partial", "turn_steps"}), untagged=True)

    workload: str
    metric: str
    device: str
    device_name: str
    threads: int
    torch_version: str
    mixprec_version: str
    steps: int
    batch_size: int
    seed: int
    runs: tuple[RunResult, ...]
    tokens_per_sample: int = 0
    higher_is_better: bool = True
    synthetic: bool = False
    partial: bool = False      # interrupted (Ctrl-C): ``runs`` holds the recipes that had taken steps
    turn_steps: int = 0        # steps per turn when the recipes were interleaved; 0: one after another

    def run(self, label: str) -> RunResult:
        """The run whose label (recipe name) is ``label``."""
        for r in self.runs:
            if r.label == label:
                return r
        raise KeyError(f"no run labelled {label!r} in this report; it has {[r.label for r in self.runs]}")

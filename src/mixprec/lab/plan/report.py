"""PlanReport: what ``mixprec plan`` chose, on what evidence, what it predicts and how it verified.

JSON schema, version 1 (strict JSON, through ``lab/codec.py``)::

    schema_version, kind   1, "plan"
    workload, target, target_label, device      str
    steps, seed            int       lockstep steps per run; the seed of init and batches
    floor_db, budget       float     SQNR floor; band multiplier
    band                   {losses_a, losses_b, spread, floor, band}: fp32 from two seeds
    layers                 per planned linear, model order: name, out_features, in_features, rows,
                           format, why, flops_share, bf16_s, plan_s (predicted), candidates,
                           excluded {format: why}, evidence {format: {sqnr_db, saturated, passes, grad_snr}},
                           groups (added within version 1: an experts module's experts; 1 for a linear)
    recipe                 str       the accepted recipe ("" when none was accepted)
    step_ratio             float     predicted step time of the recipe / bf16's, on the target
    linear_ratio           float     the same over the planned linears only
    bf16_step_s            float     predicted bf16 step on the target (all ops, roofline)
    saved_bytes_bf16, saved_bytes_plan   int   activations autograd saved on step 0 (measured here)
    bf16_losses            [float]   the lockstep reference
    attempts               per verification: recipe, losses, gap (tail - bf16 tail), inside, raised
    accepted               bool
    seconds                float     wall time of the whole plan, here
    not_planned            [str] (added within version 1): expert projections no counted forward called: kept bf16
    contrast               null, or (added within version 1) {format, recipe, losses, gap, inside}: one
                           format on every planned layer that takes it, trained lockstep (``--contrast``)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..codec import JsonReport, Schema

__all__ = ["PlanReport", "PlanLayerReport", "FormatEvidence", "Attempt", "Contrast", "BandReport"]


@dataclasses.dataclass(frozen=True)
class FormatEvidence:
    sqnr_db: float          # the lower of output and weight-gradient SQNR, one step, local (the what-if)
    saturated: float
    passes: bool
    grad_snr: float         # end-to-end weight-gradient SNR against fp32 (evidence.gradient_snr)


@dataclasses.dataclass(frozen=True)
class PlanLayerReport:
    name: str
    out_features: int
    in_features: int
    rows: int
    format: str
    why: str
    flops_share: float
    bf16_s: float
    plan_s: float
    candidates: tuple[str, ...]
    excluded: dict[str, str]
    evidence: dict[str, FormatEvidence]
    groups: int = 1         # an experts module: its experts (out, in: its first projection's, per expert)


@dataclasses.dataclass(frozen=True)
class Attempt:
    recipe: str
    losses: tuple[float, ...]
    gap: float
    inside: bool
    raised: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Contrast:
    """One low format on every planned layer that can take it, trained lockstep beside the plan."""

    format: str
    recipe: str
    losses: tuple[float, ...]
    gap: float
    inside: bool


@dataclasses.dataclass(frozen=True)
class BandReport:
    losses_a: tuple[float, ...]
    losses_b: tuple[float, ...]
    spread: float
    floor: float
    band: float


@dataclasses.dataclass(frozen=True)
class PlanReport(JsonReport):
    """The plan of one workload for one target; ``table``/``html`` render it, ``to_json`` keeps it."""

    SCHEMA: ClassVar[Schema] = Schema("plan", 1, added=frozenset({"contrast", "not_planned", "layers[].groups"}))

    workload: str
    target: str
    target_label: str
    device: str
    steps: int
    seed: int
    floor_db: float
    budget: float
    band: BandReport
    layers: tuple[PlanLayerReport, ...]
    recipe: str
    step_ratio: float
    linear_ratio: float
    bf16_step_s: float
    saved_bytes_bf16: int
    saved_bytes_plan: int
    bf16_losses: tuple[float, ...]
    attempts: tuple[Attempt, ...]
    accepted: bool
    seconds: float
    contrast: Contrast | None = None
    not_planned: tuple[str, ...] = ()

    @property
    def verified(self) -> Attempt | None:
        """The accepted attempt, or None."""
        return next((a for a in self.attempts if a.inside), None) if self.accepted else None

    @property
    def failing(self) -> tuple[str, ...]:
        """After a rejected plan: the layers still low-precision in the last attempt, and the gap."""
        if self.accepted or not self.attempts:
            return ()
        last = self.attempts[-1]
        gaps = tuple(f"try {i}: gap {a.gap:+.4f} nats against a band of {self.band.band:.4f}"
                     for i, a in enumerate(self.attempts, 1) if a.recipe != last.recipe or a is not last)
        if all(lay.format == "bf16" for lay in self.layers):      # raised to bf16, or nothing passed
            return last.raised + gaps
        return tuple(f"{lay.name} ({lay.format})" for lay in self.layers if lay.format != "bf16") + \
            (f"gap {last.gap:+.4f} nats against a band of {self.band.band:.4f}",)

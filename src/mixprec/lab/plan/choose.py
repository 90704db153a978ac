"""The plan's choice: per layer the fastest format its evidence allows, and the recipe that spells it.

Layers are taken from the most costly (bf16 time on the target) down; each takes the candidate with the
least predicted time among those whose evidence passes (``LayerEvidence.passes``: output and
weight-gradient SQNR at or above the floor, nothing saturated, every extra measure passing), or stays
bf16 when none is faster. A verification that leaves the band ``raise_most_sensitive`` moves the layers
with the least SQNR margin one step up: to the fastest candidate more accurate on that layer, bf16 last::

    choice = choose(layers, evidence)                 # {"blocks.0.mlp.c_fc": Pick("rowwise", "..."), ...}
    recipe = recipe_for(choice)                       # "bf16,fp8=rowwise(skip=...,layers=...)"
"""

from __future__ import annotations

import collections
import dataclasses
import math

from ...recipe import Fp8Config, Fp8Scaling, Recipe, get_recipe
from .candidates import WHAT_IF_NAMES, PlanLayer

__all__ = ["LayerEvidence", "Pick", "choose", "raise_most_sensitive", "recipe_for", "what_if_evidence"]


@dataclasses.dataclass(frozen=True)
class LayerEvidence:
    """What one format would do to one layer: its one-step SQNRs, saturation and extra measures."""

    format: str
    sqnr_out_db: float
    sqnr_grad_w_db: float
    saturated: float                          # the largest share of an operand clipped at the format's max
    extra: dict[str, float] = dataclasses.field(default_factory=dict)
    extra_ok: bool = True

    @property
    def sqnr_db(self) -> float:
        """The lower SQNR (inf for bf16, the reference itself)."""
        return min(self.sqnr_out_db, self.sqnr_grad_w_db)

    def passes(self, floor_db: float) -> bool:
        return self.sqnr_db >= floor_db and self.saturated == 0 and self.extra_ok

    def shortfall(self, floor_db: float) -> str:
        """Why it fails, by how much (empty when it passes)."""
        why = []
        if not self.sqnr_db >= floor_db:
            why.append(f"SQNR {self.sqnr_db:.1f} dB, {floor_db - self.sqnr_db:.1f} dB under the {floor_db:g} dB floor")
        if self.saturated:
            why.append(f"{self.saturated:.2%} of an operand saturates")
        if not self.extra_ok:
            why.append("fails " + ", ".join(f"{k} = {v:.3g}" for k, v in self.extra.items())
                       + (" (gradient SNR floor sqrt(3))" if "grad_snr" in self.extra else ""))
        return "; ".join(why)


BF16_EVIDENCE = LayerEvidence("bf16", math.inf, math.inf, 0.0)


@dataclasses.dataclass(frozen=True)
class Pick:
    """A layer's format and the one-line reason for it."""

    format: str
    why: str


def _evidence(ev: dict[str, LayerEvidence], fmt: str) -> LayerEvidence:
    return BF16_EVIDENCE if fmt == "bf16" else ev[fmt]


def choose(layers: tuple[PlanLayer, ...], evidence: dict[str, dict[str, LayerEvidence]], floor_db: float,
           banned: frozenset[tuple[str, str]] = frozenset()) -> dict[str, Pick]:
    """The fastest passing format per layer, most costly layers first; ``banned`` (layer, format) pairs
    are out (a verification ruled them out)."""
    picks: dict[str, Pick] = {}
    for layer in sorted(layers, key=lambda lay: -lay.cost("bf16")):
        ev = evidence[layer.name]
        bf16 = layer.cost("bf16")
        ok = [f for f in layer.candidates if f != "bf16" and (layer.name, f) not in banned
              and _evidence(ev, f).passes(floor_db)]
        best = min(ok, key=layer.cost, default=None)
        if best is None:
            failing = [f"{f}: {_evidence(ev, f).shortfall(floor_db) or 'ruled out by verification'}"
                       for f in layer.candidates if f != "bf16"]
            picks[layer.name] = Pick("bf16", "no low format passes (" + "; ".join(failing) + ")"
                                     if failing else "no low format runs here")
        elif layer.cost(best) >= bf16:
            picks[layer.name] = Pick("bf16", f"{best} passes but is predicted slower "
                                             f"({layer.cost(best) / bf16:.2f}x bf16's time: its casts cost "
                                             "more than its GEMMs save at this shape)")
        else:
            e = _evidence(ev, best)
            picks[layer.name] = Pick(best, f"fastest passing ({layer.cost(best) / bf16:.2f}x bf16's time), "
                                           f"SQNR {e.sqnr_db:.1f} dB")
    return picks


def raise_most_sensitive(layers: tuple[PlanLayer, ...], evidence: dict[str, dict[str, LayerEvidence]],
                         picks: dict[str, Pick], floor_db: float, banned: frozenset[tuple[str, str]],
                         count: int) -> tuple[dict[str, Pick], frozenset[tuple[str, str]], list[str]]:
    """Move the ``count`` low-precision layers with the least SQNR margin one step up (the fastest
    candidate with a higher SQNR there, or bf16); returns the picks, the grown ban list and the raised."""
    by_name = {lay.name: lay for lay in layers}
    low = [n for n, p in picks.items() if p.format != "bf16"]
    low.sort(key=lambda n: _evidence(evidence[n], picks[n].format).sqnr_db)
    banned, raised = set(banned), []
    picks = dict(picks)
    for name in low[:count]:
        layer, now = by_name[name], picks[name].format
        banned.add((name, now))
        here = _evidence(evidence[name], now).sqnr_db
        up = [f for f in layer.candidates if f != "bf16" and (name, f) not in banned
              and _evidence(evidence[name], f).passes(floor_db) and _evidence(evidence[name], f).sqnr_db > here
              and layer.cost(f) < layer.cost("bf16")]
        new = min(up, key=layer.cost, default="bf16")
        picks[name] = Pick(new, f"raised from {now} after a verification left the band"
                           + (f"; SQNR {_evidence(evidence[name], new).sqnr_db:.1f} dB" if new != "bf16" else ""))
        raised.append(f"{name}: {now} -> {new}")
    return picks, frozenset(banned), raised


def recipe_for(picks: dict[str, Pick], keep: tuple[str, ...] = (),
               experts: dict[str, tuple[str, ...]] | None = None) -> Recipe:
    """bf16 with the low-precision layers in fp8: the most common format leads, the others are
    ``layers=`` rules, the planned layers kept bf16 are ``skip=``; exact names, in model order.
    ``experts``: experts modules among the picks, with their projections' names: kept bf16 by skipping
    both, given a rule by ``NAME*`` (the module and its projections). ``keep``: names outside the plan
    that the fp8 swap would take (unplanned expert projections), skipped too."""
    experts = experts or {}
    low = {n: p.format for n, p in picks.items() if p.format != "bf16"}
    if not low:
        return get_recipe("bf16")
    lead = collections.Counter(low.values()).most_common(1)[0][0]
    rules = tuple((f"{n}*" if n in experts else n, Fp8Scaling(f)) for n, f in low.items() if f != lead)
    skip = tuple(s for n, p in picks.items() if p.format == "bf16" for s in experts.get(n, (n,))) + tuple(keep)
    return get_recipe(f"bf16,fp8={Fp8Config(scaling=Fp8Scaling(lead), skip=skip, layers=rules)}")


def what_if_evidence(what_if, fmt: str) -> LayerEvidence:
    """The doctor's what-if of one layer (``LayerWhatIf``) under ``fmt`` as the plan's evidence."""
    r = what_if.result(WHAT_IF_NAMES[fmt])
    sq_out = r.sqnr_out_db if not math.isnan(r.sqnr_out_db) else -math.inf
    sq_gw = r.sqnr_grad_w_db if not math.isnan(r.sqnr_grad_w_db) else -math.inf
    return LayerEvidence(fmt, sq_out, sq_gw, r.saturated())

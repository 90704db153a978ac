"""The plan: from per-layer evidence to the fastest recipe that trains like fp32 here, verified.

``plan_setup`` checks every input (target, workload, steps, the model has layers to plan) before any
training; ``run_plan`` then:

1. trains fp32 from two seeds: the band (``evidence.fp32_band``; a workload that diverges is an error);
2. trains bf16 lockstep from the plan's seed: the reference curve, with the doctor's what-if measured on
   its last step (per layer and format: SQNRs, saturation) and one step costed on the target's roofline;
   then, per format, the end-to-end weight-gradient SNR against fp32 at bf16's last weights and batch
   (``evidence.gradient_snr``: below sqrt(3) a format fails the layer);
3. chooses per layer the fastest candidate whose evidence passes (``choose.py``), spells it as a recipe;
4. verifies: trains the recipe lockstep with bf16 and accepts it when its tail loss is within the band
   of bf16's; otherwise raises the most sensitive layers one step and tries again (``retries`` times);
5. with ``contrast="nvfp4"`` (any low format the target runs), also trains that one format on every
   planned layer that can take it, lockstep from the same init: what the plan's per-layer choice saved
   the user from (or that it cost nothing), on the same band.

::

    setup = plan_setup("gpt", target="h100", steps=40)
    report = run_plan(setup)
    report.recipe               # "params=fp32,compute=bf16,...,fp8=rowwise(skip=...,layers=...)"

``plan_model`` is the same for a model of your own (a model function, an optimizer function, a few
batches, a loss).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ...devices import resolve_device
from ...diagnostics.speed_model import Target, get_target, step_profile
from ...model_io import predictions
from ..trainer import batch_order, check_seed, check_steps
from ..workload import Split, Workload
from ..workloads import get_workload
from .candidates import LOW_FORMATS, PlanLayer, count_rows, plan_layers, unplanned_experts
from .choose import BF16_EVIDENCE, LayerEvidence, Pick, choose, raise_most_sensitive, recipe_for, what_if_evidence
from .evidence import GRAD_SNR_THRESHOLD, LayerMeasure, capture_what_if, fp32_band, gradient_snr, lockstep, tail
from .report import Attempt, BandReport, Contrast, FormatEvidence, PlanLayerReport, PlanReport

__all__ = ["PlanSetup", "plan_setup", "run_plan", "plan_model", "DEFAULT_STEPS", "DEFAULT_FLOOR_DB"]

DEFAULT_STEPS = 40          # lockstep steps per run: ~6 runs fit the 5-minute budget on a 2-core CPU
DEFAULT_FLOOR_DB = 20.0     # the doctor's what-if floor: an error carrying 1% of the signal's energy
DEFAULT_RETRIES = 3


@dataclasses.dataclass(frozen=True)
class PlanSetup:
    """A checked plan: the workload, the target, and the model's plannable layers on it."""

    workload: Workload
    target: Target
    device: torch.device
    steps: int
    seed: int
    floor_db: float
    budget: float
    retries: int
    layers: tuple[PlanLayer, ...]
    measures: tuple[tuple[str, LayerMeasure], ...] = ()
    contrast: str | None = None
    kept: tuple[str, ...] = ()                # fp8-eligible weights the plan does not measure: kept bf16


def plan_setup(workload: str | Workload = "gpt", *, target: str | Target = "h100", steps: int = DEFAULT_STEPS,
               seed: int = 0, floor_db: float = DEFAULT_FLOOR_DB, budget: float = 1.0,
               retries: int = DEFAULT_RETRIES, device: str | torch.device = "cpu",
               measures: Iterable[tuple[str, LayerMeasure]] = (), contrast: str | None = None) -> PlanSetup:
    """Check every input (ValueError names the fix) and find the layers to plan; trains nothing."""
    target_spec = target if isinstance(target, Target) else get_target(target)
    steps, seed = check_steps(steps), check_seed(seed)
    if steps < 8:
        raise ValueError(f"--steps must be at least 8 for a plan (its tail is the last quarter), got {steps}")
    if not (isinstance(floor_db, (int, float)) and math.isfinite(floor_db)):
        raise ValueError(f"--floor-db must be a finite number of dB (e.g. 20), got {floor_db!r}")
    if not (isinstance(budget, (int, float)) and budget > 0 and math.isfinite(budget)):
        raise ValueError(f"--budget must be a positive multiple of fp32's seed band (e.g. 1), got {budget!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
        raise ValueError(f"--retries must be an integer in 0..10, got {retries!r}")
    if not isinstance(workload, Workload):
        workload = get_workload(workload)
    device = device if isinstance(device, torch.device) else resolve_device(device)
    data = workload.load_data()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = workload.build_model()
    x = data.x_train[:workload.batch_size]
    rows = count_rows(model, lambda: predictions(model(x)))
    layers = plan_layers(model, rows, target_spec)
    if not layers:
        raise ValueError(f"{workload.name} has no linear layer the plan can put in low precision (it needs plain "
                         "nn.Linear or HF Conv1D layers with both weight dimensions multiples of 16); there "
                         "is nothing to plan: train it in bf16")
    if contrast is not None:
        _check_contrast(contrast, target_spec, layers)
    return PlanSetup(workload, target_spec, device, steps, seed, float(floor_db), float(budget), retries, layers,
                     tuple(measures), contrast, unplanned_experts(model, rows))


def _check_contrast(fmt: object, target: Target, layers: tuple[PlanLayer, ...]) -> None:
    if fmt not in LOW_FORMATS:
        raise ValueError(f"--contrast must be one low-precision format ({', '.join(LOW_FORMATS)}), got {fmt!r}")
    if fmt not in target.kernels:
        raise ValueError(f"--contrast {fmt}: {target.name} has no {fmt} kernel, so no plan for it would use "
                         f"{fmt}; name one of {', '.join(f for f in LOW_FORMATS if f in target.kernels)}")
    if not any(fmt in lay.candidates for lay in layers):
        why = "; ".join(f"{lay.name}: {lay.excluded[fmt]}" for lay in layers)
        raise ValueError(f"--contrast {fmt}: no planned layer can take it ({why})")


def run_plan(setup: PlanSetup, on_progress: Callable[[str], None] | None = None) -> PlanReport:
    """Band, evidence, choice, verification (module docstring); the report, accepted or not."""
    say = on_progress or (lambda _msg: None)
    start = time.perf_counter()
    w, s = setup.workload, setup
    say(f"fp32 from seeds {s.seed} and {s.seed + 1}: the band")
    band = fp32_band(w, steps=s.steps, seed=s.seed, device=s.device, budget=s.budget)
    say("bf16 lockstep: the reference, the what-if on its last step, one step costed on the target")
    what_if, weights, experts = {}, {}, {}
    profile: list = []
    bf16 = lockstep(w, "bf16", steps=s.steps, seed=s.seed, device=s.device,
                    last_step=lambda model: capture_what_if(model, what_if, weights, experts),
                    first_step=lambda mp: profile.append(_profile(w, mp, s)))
    snr: dict[str, dict[str, float]] = {}
    for fmt in dict.fromkeys(f for lay in s.layers for f in lay.candidates if f != "bf16"):
        say(f"{fmt}: end-to-end weight-gradient SNR against fp32, per layer")
        snr[fmt] = gradient_snr(w, weights, fmt, step=s.steps - 1, seed=s.seed, steps=s.steps, device=s.device,
                                layers=[lay.name for lay in s.layers if fmt in lay.candidates],
                                projections=_experts(s))
    evidence = {lay.name: _layer_evidence(lay, what_if.get(lay.name), experts.get(lay.name), s, snr)
                for lay in s.layers}
    picks = choose(s.layers, evidence, s.floor_db)
    banned: frozenset = frozenset()
    attempts: list[Attempt] = []
    raised: list[str] = []
    plan_run = bf16
    for attempt in range(s.retries + 1):
        recipe = recipe_for(picks, s.kept, _experts(s))
        if all(p.format == "bf16" for p in picks.values()):
            # Nothing low-precision left: the recipe is bf16 itself, the reference (nothing to verify).
            # Accepted only when bf16 is what the speed model prefers, not where a faster format failed
            # the evidence: then the budget is what nothing met.
            # Raised here after failed verifications: the band is what nothing met.
            unmet = _unmet(s, evidence)
            attempts.append(Attempt(str(recipe), bf16.losses, 0.0, not unmet and not attempts,
                                    tuple(raised) + unmet))
            break
        say(f"verify attempt {attempt + 1}: {recipe}")
        plan_run = lockstep(w, recipe, steps=s.steps, seed=s.seed, device=s.device)
        gap = plan_run.tail - bf16.tail
        inside = math.isfinite(gap) and gap <= band.band
        attempts.append(Attempt(str(recipe), plan_run.losses, gap, inside, tuple(raised)))
        if inside:
            break
        count = max(1, sum(p.format != "bf16" for p in picks.values()) // 4)
        picks, banned, raised = raise_most_sensitive(s.layers, evidence, picks, s.floor_db, banned, count)
    accepted = bool(attempts) and attempts[-1].inside
    contrast = _contrast(s, bf16, band, attempts, say) if s.contrast is not None else None
    return _report(s, band, bf16, plan_run, profile[0] if profile else math.nan, evidence, picks,
                   tuple(attempts), accepted, time.perf_counter() - start, contrast)


def _contrast(s: PlanSetup, bf16, band, attempts: list[Attempt], say: Callable[[str], None]) -> Contrast:
    """``s.contrast`` on every planned layer that takes it, lockstep with bf16 (a verification that
    already trained that recipe is reused: same seed, same losses)."""
    recipe = str(recipe_for({lay.name: Pick(s.contrast if s.contrast in lay.candidates else "bf16", "")
                             for lay in s.layers}, s.kept, _experts(s)))
    losses = next((a.losses for a in attempts if a.recipe == recipe), None)
    if losses is None:
        say(f"contrast: {recipe}")
        losses = lockstep(s.workload, recipe, steps=s.steps, seed=s.seed, device=s.device).losses
    gap = tail(losses) - bf16.tail
    return Contrast(s.contrast, recipe, losses, gap, math.isfinite(gap) and gap <= band.band)


def _unmet(s: PlanSetup, evidence) -> tuple[str, ...]:
    """Layers where a format predicted faster than bf16 failed the evidence, with by how much."""
    out = []
    for lay in s.layers:
        faster = [f for f in lay.candidates if f != "bf16" and lay.cost(f) < lay.cost("bf16")]
        if faster and not any(evidence[lay.name][f].passes(s.floor_db) for f in faster):
            out.append(f"{lay.name}: " + "; ".join(f"{f} {evidence[lay.name][f].shortfall(s.floor_db)}"
                                                    for f in faster))
    return tuple(out)


def _profile(w: Workload, mp, s: PlanSetup) -> float:
    """One bf16 step of the workload costed op by op on the target (a copy of the model: untouched)."""
    model = copy.deepcopy(mp.model)
    data = w.load_data()
    idx = batch_order(len(data.y_train), w.batch_size, 1, s.seed)[0]
    x, y = data.x_train[idx].to(s.device), data.y_train[idx].to(s.device)

    def step() -> None:
        with torch.autocast(s.device.type, dtype=torch.bfloat16):
            loss = w.loss_fn(predictions(model(x)), y)
        loss.backward()
        for p in model.parameters():          # what AdamW moves: read p, g, m, v; write p, m, v
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-1e-9)
    return step_profile(step, s.target).seconds + _adam_seconds(model, s.target)


def _adam_seconds(model: nn.Module, target: Target) -> float:
    # fp32 AdamW: 7 x 4 bytes per parameter (read p, g, m, v; write p, m, v), minus the sgd-like pass
    # the profile already counted (read p, g; write p).
    n = sum(p.numel() for p in model.parameters())
    return 4 * 4 * n / (target.hbm_tb_s * 1e12)


def _weight(lay: PlanLayer) -> tuple[int, int]:
    """(out, in) features: a linear's weight, or an experts module's first projection per expert."""
    shape = lay.parts[0] if lay.parts else lay.shape
    return shape.n, shape.k


def _experts(s: PlanSetup) -> dict[str, tuple[str, ...]]:
    return {lay.name: lay.projections for lay in s.layers if lay.projections}


def _layer_evidence(layer: PlanLayer, what_if, experts_ev: LayerEvidence | None, s: PlanSetup,
                    snr: dict) -> dict[str, LayerEvidence]:
    out = {"bf16": BF16_EVIDENCE}
    for fmt in layer.candidates:
        if fmt == "bf16":
            continue
        if layer.projections:                 # an experts module: measured at the module (experts.py)
            ev = experts_ev if experts_ev is not None else LayerEvidence(fmt, -math.inf, -math.inf, 0.0)
        elif what_if is None:                 # the layer got no gradient in the captured step
            out[fmt] = LayerEvidence(fmt, -math.inf, -math.inf, 0.0)
            continue
        else:
            ev = what_if_evidence(what_if, fmt)
        g = snr.get(fmt, {}).get(layer.name, math.inf)
        extra, ok = {"grad_snr": g}, g >= GRAD_SNR_THRESHOLD
        for name, measure in s.measures:
            value, passes = measure(what_if, fmt)
            extra[name], ok = float(value), ok and bool(passes)
        out[fmt] = dataclasses.replace(ev, extra=extra, extra_ok=ok)
    return out


def _report(s: PlanSetup, band, bf16, plan_run, bf16_step_s, evidence, picks, attempts, accepted,
            seconds, contrast) -> PlanReport:
    flops = sum(lay.shape.flops for lay in s.layers)
    rows, bf16_lin, plan_lin = [], 0.0, 0.0
    for lay in s.layers:
        fmt = picks[lay.name].format if accepted else "bf16"
        shown = picks[lay.name]
        bf16_lin += lay.cost("bf16")
        plan_lin += lay.cost(fmt)
        rows.append(PlanLayerReport(
            lay.name, *_weight(lay), lay.shape.m, shown.format, shown.why,
            lay.shape.flops / flops if flops else 0.0, lay.cost("bf16"), lay.cost(shown.format),
            lay.candidates, dict(lay.excluded),
            {f: FormatEvidence(e.sqnr_db, e.saturated, e.passes(s.floor_db), e.extra.get("grad_snr", math.inf))
             for f, e in evidence[lay.name].items() if f != "bf16"}, lay.parts[0].groups if lay.parts else 1))
    # The rest of the step (attention, norms, the optimizer): the profiled bf16 step less its linears,
    # which the profile may count with fewer GEMMs (a first layer computes no input gradient): >= 0.
    rest = max(bf16_step_s - bf16_lin, 0.0)
    bf16_step_s, plan_step = rest + bf16_lin, rest + plan_lin
    return PlanReport(
        workload=s.workload.name, target=s.target.name, target_label=s.target.label, device=str(s.device),
        steps=s.steps, seed=s.seed, floor_db=s.floor_db, budget=s.budget,
        band=BandReport(band.losses_a, band.losses_b, band.spread, band.floor, band.band),
        layers=tuple(rows), recipe=attempts[-1].recipe if accepted else "",
        step_ratio=plan_step / bf16_step_s if bf16_step_s > 0 else math.nan,
        linear_ratio=plan_lin / bf16_lin if bf16_lin > 0 else math.nan, bf16_step_s=bf16_step_s,
        saved_bytes_bf16=bf16.saved_bytes, saved_bytes_plan=plan_run.saved_bytes,
        bf16_losses=bf16.losses, attempts=attempts, accepted=accepted, seconds=seconds, contrast=contrast,
        not_planned=s.kept)


def plan_model(make_model: Callable[[], nn.Module], make_optimizer: Callable, x: torch.Tensor,
               y: torch.Tensor, loss_fn: Callable, *, target: str | Target = "h100", batch_size: int | None = None,
               name: str = "model", **options) -> PlanReport:
    """``run_plan`` for your own model: ``make_model()`` builds it (seeded by the plan), ``make_optimizer``
    takes its parameters, ``(x, y)`` are training rows drawn in batches of ``batch_size`` (default all),
    ``loss_fn(outputs, y)`` the loss. ``options``: those of ``plan_setup`` (steps, seed, floor_db, ...)."""
    batch = len(x) if batch_size is None else batch_size
    workload = Workload(name=name, summary="a model planned through mixprec.lab.plan.plan_model",
                        build_model=make_model, load_data=lambda: Split(x, y, x[:1], y[:1]), loss_fn=loss_fn,
                        make_optimizer=make_optimizer, metric=lambda out, t: float("nan"), metric_name="loss",
                        batch_size=batch, default_steps=DEFAULT_STEPS, higher_is_better=False)
    return run_plan(plan_setup(workload, target=target, **options))


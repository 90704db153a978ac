"""The doctor experiment: train a workload a few steps under one recipe and measure its ranges per layer.

Two phases, like compare: ``plan_doctor`` checks every input (workload, recipe and device, steps, seed,
module names) before anything trains; ``run_doctor`` trains with a
:class:`~mixprec.diagnostics.range_collector.RangeCollector` open on every step and returns a typed
:class:`~mixprec.lab.doctor.report.DoctorReport`::

    plan = plan_doctor("mlp", "fp16", steps=20, device="cpu")
    report = run_doctor(plan)
    report.window.recommended            # log2 of the recommended loss scale, or None
    report.modules[0].stats["weight_grads"].fraction("fp16", "flush")

Default recipe ``fp16`` (torch.amp's O1 with a dynamic loss scale): gradients are measured in true
units (divided by the scale), so the histograms show what fp16 *without* scaling would flush, and the
report sets the scaler's choice beside the recommended window. Under ``scale=none`` the flushed
gradients are already zeros when they are counted: the doctor says so. Under an fp8 recipe it also
counts, exactly, the values every fp8 cast flushed or saturated (``report.fp8_layers``) and keeps the
swap report (``report.fp8_swap``). With ``what_if=WhatIfOptions()`` it captures every linear layer's
input, weight and output gradient on the last step and measures what each fp8/fp4 format would do to
them (``report.what_if``; see ``what_if.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from ... import __version__
from ...devices import device_name, supports
from ...fp8.stats import count_fp8_ranges, fp8_layer_stats
from ...diagnostics.range_collector import RangeCollector, select_modules
from ...diagnostics.scale_window import MARGIN, SMALL_FRACTION, scale_window
from ...engine import MixedPrecision
from ...loss_scale.scales import NoLossScale
from ...recipe import RECIPES, Recipe, get_recipe
from .report import DoctorReport
from .grad_snr import gradient_snr, with_grad_snr
from .what_if import WhatIfCapture, measure_what_if
from .what_if_report import FORMATS, WhatIfOptions
from ..trainer import TrainProgress, batch_order, check_recipe_patterns, check_seed, check_steps, resolve_run
from ..workloads import Workload

__all__ = ["DEFAULT_RECIPE", "DEFAULT_STEPS", "DoctorPlan", "plan_doctor", "run_doctor"]

DEFAULT_RECIPE = "fp16"
DEFAULT_STEPS = 20      # "a few steps": enough for the ranges to settle, seconds on a CPU


@dataclasses.dataclass(frozen=True)
class DoctorPlan:
    """A validated doctor run: the recipe runs on ``device``, the module names exist."""

    workload: Workload
    recipe: Recipe
    device: torch.device
    steps: int
    seed: int
    modules: tuple[str, ...] | None = None
    what_if: WhatIfOptions | None = None      # None: no what-if


def plan_doctor(workload: str | Workload = "mlp", recipe: str | Recipe = DEFAULT_RECIPE, *,
                steps: int | None = None, device: str | torch.device | None = "auto", seed: int = 0,
                modules: Sequence[str] | None = None, what_if: WhatIfOptions | None = None) -> DoctorPlan:
    """Check everything a doctor run needs before it trains; ValueError/TypeError name the fix.

    Builds the workload's model once (on the CPU, the caller's random state untouched) to check that
    it has trainable parameters and that ``modules`` name real submodules.
    """
    workload, device = resolve_run(workload, device, steps)
    steps = DEFAULT_STEPS if steps is None else check_steps(steps)
    seed = check_seed(seed)
    recipe = get_recipe(recipe)
    support = supports(recipe, device)
    if not support.ok:
        runnable = [n for n, r in RECIPES.items() if supports(r, device).ok]
        raise ValueError(f"recipe {recipe.label!r} cannot run on {device}: {support.reason} "
                         f"(recipes {device.type} can run: {', '.join(runnable)})")
    with torch.random.fork_rng(devices=[]):
        model = workload.build_model()
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"workload {workload.name!r}: its model ({type(model).__name__}) has no trainable "
                         "parameters, so there are no gradients or updates to diagnose; give it layers "
                         "with weights")
    check_recipe_patterns(model, recipe)    # a name that matches nothing: refused before training
    if modules is not None:
        modules = tuple(m.strip() for m in modules if m.strip())
        if not modules:
            raise ValueError("--modules is empty; name modules as model.named_modules() prints them, "
                             "e.g. --modules 0,2")
        select_modules(model, modules)      # raises with close matches for an unknown name
    if what_if is not None and not isinstance(what_if, WhatIfOptions):
        raise TypeError(f"what_if must be a WhatIfOptions (e.g. WhatIfOptions(floor_db=20)) or None, "
                        f"got {type(what_if).__name__}")
    return DoctorPlan(workload, recipe, device, steps, seed, modules, what_if)


def run_doctor(plan: DoctorPlan, on_progress: Callable[[TrainProgress], None] | None = None) -> DoctorReport:
    """Train ``plan.steps`` steps from seed-fixed weights, collecting ranges on every one; report.

    The weights and minibatch order are the ones ``mixprec compare`` uses for the same seed.
    Syncs with the host on each progress report and at the end.
    """
    w, device = plan.workload, plan.device
    data = w.load_data().to(device)
    order = batch_order(len(data.y_train), w.batch_size, plan.steps, plan.seed).to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.seed)
        model = w.build_model()
    model.to(device)
    mp = MixedPrecision(model, w.make_optimizer(model.parameters()), plan.recipe, seed=plan.seed)
    collector = RangeCollector(mp, plan.modules)
    if mp.fp8_report is not None:
        count_fp8_ranges(model)        # exact flushed/saturated counts in every fp8 cast of the run
    capture = None
    if plan.what_if is not None:       # the last step's operands; 1/S keeps gradients in true units
        capture = WhatIfCapture(model, plan.modules, max_rows=plan.what_if.max_rows,
                                inverse_scale=lambda: None if isinstance(mp.loss_scale, NoLossScale)
                                else mp.loss_scale.value.reciprocal())   # a power of two: exact
    losses_t, scales_t = [], []
    model.train()
    if on_progress is not None:
        on_progress(TrainProgress(0, plan.steps, math.nan, math.nan))
    for step in range(plan.steps):
        idx = order[step]                                             # (B,)
        last = capture is not None and step == plan.steps - 1
        with collector.collecting(), capture.capturing() if last else contextlib.nullcontext():
            with mp.autocast():
                loss = w.loss_fn(model(data.x_train[idx]), data.y_train[idx])
            mp.backward(loss)
            result = mp.step()
        mp.zero_grad()
        losses_t.append(loss.detach())
        scales_t.append(result.scale_t)
        if on_progress is not None:
            on_progress(TrainProgress(step + 1, plan.steps, float(losses_t[-1]), math.nan))
    ranges = collector.result()
    fp8 = fp8_layer_stats(model) if mp.fp8_report is not None else ()     # one host sync
    what_if = None if capture is None else measure_what_if(capture, plan.what_if, step=plan.steps)
    if what_if is not None and plan.what_if.grad_snr and what_if.layers:
        # The whole model in each format against fp32, from the final weights on the last step's batch.
        x_last, y_last = data.x_train[order[-1]], data.y_train[order[-1]]
        snr = gradient_snr(w.build_model, model.state_dict(), lambda m: w.loss_fn(m(x_last), y_last),
                           FORMATS, layers=[layer.name for layer in what_if.layers], device=device,
                           seed=plan.seed)
        what_if = with_grad_snr(what_if, snr)
    return DoctorReport(
        workload=w.name, recipe=str(plan.recipe), label=plan.recipe.label, device=str(device),
        device_name=device_name(device), torch_version=torch.__version__, mixprec_version=__version__,
        steps=plan.steps, batch_size=w.batch_size, seed=plan.seed,
        losses=tuple(torch.stack(losses_t).float().tolist()), scales=tuple(torch.stack(scales_t).tolist()),
        skipped_steps=mp.skipped_steps, scaled=plan.recipe.loss_scale.kind != "none",
        small_fraction=SMALL_FRACTION, margin=MARGIN, modules=ranges.modules,
        window=scale_window(ranges.gradients()), fp8_layers=fp8, fp8_swap=mp.fp8_report,
        what_if=what_if)


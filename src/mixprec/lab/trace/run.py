"""The trace experiment: which op ran in which dtype, for one forward and backward of a workload.

The batch is the workload's first ``batch_size`` training rows; the model is built from ``seed`` exactly
as ``mixprec compare`` builds it::

    plan = plan_trace("gpt", "bf16,fp32_ops=layer_norm", device="cpu", batch_size=4)
    report = run_trace(plan)
    report.select(module="lm_head", phase="forward", op="addmm")[0].output      # "bf16"
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...devices import resolve_device, supports
from ...diagnostics.optrace import trace_ops
from ...recipe import RECIPES, Recipe, get_recipe
from ..trainer import check_recipe_patterns, check_seed
from ..workloads import Workload, get_workload
from .report import TraceReport

__all__ = ["TracePlan", "plan_trace", "run_trace"]


@dataclasses.dataclass(frozen=True)
class TracePlan:
    """A checked trace run: the recipe runs on ``device``, and its module patterns match ``model``."""

    workload: Workload
    recipe: Recipe
    device: torch.device
    model: nn.Module           # built from the seed, on ``device``
    x: torch.Tensor            # the first batch_size training rows, on ``device``
    y: torch.Tensor


def plan_trace(workload: str | Workload = "mlp", recipe: str | Recipe = "bf16", *,
               device: str | torch.device | None = "auto", batch_size: int | None = None,
               seed: int = 0) -> TracePlan:
    """Check every input (ValueError/TypeError name the fix) and build the model the trace runs."""
    recipe = get_recipe(recipe)
    seed = check_seed(seed)
    if not isinstance(workload, Workload):
        workload = get_workload(workload)
    device = device if isinstance(device, torch.device) else resolve_device(device)
    support = supports(recipe, device)
    if not support.ok:
        runnable = [n for n, r in RECIPES.items() if supports(r, device).ok]
        raise ValueError(f"recipe {recipe.label!r} cannot run on {device}: {support.reason} "
                         f"(recipes {device.type} can run: {', '.join(runnable)})")
    batch = workload.batch_size if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch!r}")
    data = workload.load_data()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = workload.build_model()
    model.to(device)
    check_recipe_patterns(model, recipe)      # before any work: a name that matches nothing is a typo
    return TracePlan(workload, recipe, device, model, data.x_train[:batch].to(device),
                     data.y_train[:batch].to(device))


def run_trace(plan: TracePlan) -> TraceReport:
    """One forward and backward of the plan's batch under its recipe, every op recorded."""
    loss_fn, x, y = plan.workload.loss_fn, plan.x, plan.y
    return TraceReport.of(trace_ops(plan.model, plan.recipe, lambda m: loss_fn(m(x), y)))

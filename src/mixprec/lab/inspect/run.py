"""The inspect experiment: where a workload's memory goes per recipe, and which matmuls miss tensor cores.

Nothing trains. The tensor-core table comes from one forward and backward traced on the meta device
(shapes only); the memory table from the engine run on fake tensors (``memory_report``), both without
allocating the model, so ``mixprec inspect --benchmark gpt2`` takes seconds on a laptop. For built-in
workloads (and for every workload on a GPU) one real step per recipe is also *measured* on a copy of the
model, and the table shows both::

    plan = plan_inspect("gpt", ["fp32", "bf16"], device="cpu")
    report = run_inspect(plan)
    report.memory[1].predicted.activations, report.misaligned_share[8]

The report and its JSON schema are in ``report.py``; its tables in ``render.py``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch

from ... import __version__
from ...devices import resolve_device, supports
from ...diagnostics.memory_report import memory_report
from ...diagnostics.tensor_cores import KernelProfile, profile_kernels, trace_matmuls
from ...engine import MixedPrecision
from ...recipe import Recipe
from ..compare.run import DEFAULT_RECIPES, unique_recipes
from ..workloads import Workload, get_workload
from .report import InspectReport, RecipeKernels

__all__ = ["InspectPlan", "plan_inspect", "run_inspect"]


@dataclasses.dataclass(frozen=True)
class InspectPlan:
    workload: Workload
    recipes: tuple[Recipe, ...]
    device: torch.device
    batch_size: int
    measure: bool


def plan_inspect(workload: str | Workload = "mlp", recipes: Sequence[str | Recipe] = DEFAULT_RECIPES, *,
                 device: str | torch.device | None = "auto", batch_size: int | None = None) -> InspectPlan:
    """Check the inputs of an inspect run; ValueError/TypeError name the fix.

    Measuring needs real memory: it happens for built-in workloads, and for benchmarks on a GPU.
    """
    if not isinstance(workload, Workload):
        workload = get_workload(workload)
    device = device if isinstance(device, torch.device) else resolve_device(device)
    if batch_size is None:
        batch_size = workload.batch_size
    elif isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
    parsed = unique_recipes(recipes, "inspect")
    measure = not workload.synthetic or device.type == "cuda"
    return InspectPlan(workload, tuple(parsed.values()), device, batch_size, measure)


def run_inspect(plan: InspectPlan) -> InspectReport:
    """Trace, predict and (per the plan) measure; returns the typed report."""
    w, notes = plan.workload, []
    model, real = _build(w, meta=not plan.measure)
    if real:
        model = model.to(plan.device)
    if not plan.measure:
        notes.append(f"{w.name} is a benchmark sized for GPUs: on {plan.device} its memory is predicted "
                     "only (fake tensors), nothing is allocated or measured")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"workload {w.name!r} builds a model without parameters: nothing to inspect")
    data = w.load_data()
    # Copies, as the trainer's minibatch gather makes: a slice would keep the whole data set's storage
    # alive in the tensors autograd saves, and the meter would count all of it.
    x, y = data.x_train[:plan.batch_size].clone(), data.y_train[:plan.batch_size].clone()
    if len(x) < plan.batch_size:
        raise ValueError(f"--batch-size {plan.batch_size} is more than the {len(x)} training rows of "
                         f"{w.name}; choose at most {len(x)}")
    if real:
        x, y = x.to(plan.device), y.to(plan.device)
    tensor_cores = trace_matmuls(model, (x, y), loss_fn=w.loss_fn)
    memory = []
    for recipe in plan.recipes:
        support = supports(recipe, plan.device)
        if plan.measure and not support.ok:
            notes.append(f"{recipe.label}: {support.reason}; predicted only")
        # measure=True trains one step on a deep copy: the same model serves every recipe.
        memory.append(memory_report(model, recipe, (x, y), optimizer=w.make_optimizer, loss_fn=w.loss_fn,
                                    measure=plan.measure and support.ok))
    kernels = []
    if plan.device.type == "cuda":
        kernels = [RecipeKernels(str(r), _profile(w, model, r, x, y).kernels)
                   for r in plan.recipes if supports(r, plan.device).ok]
    return InspectReport(workload=w.name, device=str(plan.device), batch_size=plan.batch_size,
                         torch_version=torch.__version__, mixprec_version=__version__, measured=plan.measure,
                         notes=tuple(notes), memory=tuple(memory), matmuls=tensor_cores.ops,
                         kernels=tuple(kernels))


def _profile(w: Workload, model: torch.nn.Module, recipe: Recipe, x: torch.Tensor, y: torch.Tensor
             ) -> KernelProfile:
    """Profile real training steps of a copy of ``model`` under ``recipe`` (CUDA)."""
    twin = copy.deepcopy(model)
    mp = MixedPrecision(twin, w.make_optimizer(twin.parameters()), recipe)

    def step() -> None:
        with mp.autocast():
            loss = w.loss_fn(twin(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return profile_kernels(step)


def _build(w: Workload, meta: bool):
    """The workload's model on the meta device (nothing allocated); a real one where that fails."""
    if meta:
        try:
            with torch.device("meta"):
                return w.build_model(), False
        except Exception:     # a user's builder that reads values: build it for real instead
            pass
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return w.build_model(), True

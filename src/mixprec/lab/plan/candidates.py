"""Which formats each linear layer of a model may take on a target GPU, and what each would cost there.

A layer is a candidate when the fp8 swap would take it (a plain ``nn.Linear`` or Hugging Face ``Conv1D``
with both weight dimensions multiples of 16: ``fp8/swap.py``'s rule). Its formats are bf16 plus each
fp8/fp4 scaling the target has a tensor-core kernel for (``speed_model.Target.kernels``) whose shape
rule the layer meets; a format left out is named with the reason::

    layers = plan_layers(model, rows, get_target("h100"))
    layers[0].candidates        # ("bf16", "current", "rowwise")
    layers[0].excluded          # {"block": "weight (64, 64): 128-block kernels need multiples of 128", ...}

``rows`` (tokens per step, M) are counted from one forward (``count_rows``), so the costs are those of
the workload's real GEMMs.

A mixture of experts' grouped GEMMs (Hugging Face experts modules) are candidates too, one per module
(the swap takes both projections or neither), in bf16 or per-tensor fp8, the one scaling grouped GEMMs
take (``experts.py``: their rows, costs and evidence). ``projections`` names what ``skip=`` takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ...diagnostics.speed_model import LinearCost, LinearShape, Target, linear_cost
from ...fp8.conv1d import is_hf_conv1d
from .experts import EXPERTS_EXCLUDED, experts_costs, experts_rows_hook, planned_experts, projection_names

__all__ = ["LOW_FORMATS", "WHAT_IF_NAMES", "PlanLayer", "plan_layers", "count_rows", "eligible_linears",
           "unplanned_experts"]

# The low-precision formats a plan considers (recipe/fp8.py's scaling words; ``delayed`` computes what
# ``current`` does from older amaxes, so the plan proposes ``current``), and the doctor's what-if names.
LOW_FORMATS = ("current", "rowwise", "block", "mxfp8", "nvfp4")
WHAT_IF_NAMES = {"current": "fp8", "rowwise": "fp8-rowwise", "block": "fp8-block", "mxfp8": "mxfp8",
                 "nvfp4": "nvfp4"}
# Shape rules beyond the swap's multiples of 16: the dimension every GEMM of the format blocks by.
_MULTIPLE = {"block": (128, "128-block kernels (1x128 tiles, 128x128 weight blocks) need multiples of 128"),
             "mxfp8": (32, "MXFP8 blocks of 32 elements need multiples of 32")}


@dataclasses.dataclass(frozen=True)
class PlanLayer:
    """A linear layer the plan may put in low precision: its GEMM shape, candidates and their costs."""

    name: str
    shape: LinearShape
    candidates: tuple[str, ...]               # "bf16" first, then the low formats the target runs here
    excluded: dict[str, str]                  # low format -> why it is not a candidate
    costs: dict[str, LinearCost]              # per candidate, predicted on the target
    parts: tuple[LinearShape, ...] = ()       # an experts module's two projections (groups = experts)

    def cost(self, fmt: str) -> float:
        return self.costs[fmt].seconds

    @property
    def projections(self) -> tuple[str, ...]:
        """An experts module's projection names (what skip= takes); () for a linear."""
        return tuple(p.name for p in self.parts)


def eligible_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The layers the fp8 swap would take (plain nn.Linear or HF Conv1D, dims multiples of 16), by name."""
    out = {}
    for name, m in model.named_modules():
        if name and (type(m) is nn.Linear or is_hf_conv1d(m)):
            n, k = m.weight.shape if type(m) is nn.Linear else m.weight.shape[::-1]
            if n % 16 == 0 and k % 16 == 0:
                out[name] = m
    return out


def unplanned_experts(model: nn.Module, rows: dict[str, int]) -> tuple[str, ...]:
    """The projections of experts modules the swap could take but the counted forward never called:
    no rows, nothing to plan; a plan's recipe keeps them bf16 (``skip=``) rather than unmeasured fp8."""
    return tuple(p for name, m in planned_experts(model).items() if name not in rows
                 for p in projection_names(name, m))


def count_rows(model: nn.Module, forward: Callable[[], object]) -> dict[str, int]:
    """Rows (M) each eligible linear multiplies in one call of ``forward`` (a forward pass), by name."""
    rows: dict[str, int] = {}
    layers = eligible_linears(model)

    def hook(name: str) -> Callable:
        def record(module: nn.Module, args: tuple, output: object) -> None:
            k = module.weight.shape[1] if type(module) is nn.Linear else module.weight.shape[0]
            rows[name] = rows.get(name, 0) + args[0].numel() // k
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    handles += [m.register_forward_hook(experts_rows_hook(n, rows), with_kwargs=True)
                for n, m in planned_experts(model).items()]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return rows


def plan_layers(model: nn.Module, rows: dict[str, int], target: Target) -> tuple[PlanLayer, ...]:
    """Every eligible linear that ran in the counted forward, with its candidates on ``target``."""
    out = []
    for name, m in eligible_linears(model).items():
        if name not in rows:
            continue                                   # never called: no GEMM to plan
        n, k = m.weight.shape if type(m) is nn.Linear else m.weight.shape[::-1]
        shape = LinearShape(name, rows[name], n, k)
        candidates, excluded = ["bf16"], {}
        for fmt in LOW_FORMATS:
            if fmt not in target.kernels:
                excluded[fmt] = f"no {fmt} kernel on {target.name}"
                continue
            multiple, why = _MULTIPLE.get(fmt, (16, ""))
            if n % multiple or k % multiple:
                excluded[fmt] = f"weight ({n}, {k}): {why}"
                continue
            candidates.append(fmt)
        out.append(PlanLayer(name, shape, tuple(candidates), excluded,
                             {fmt: linear_cost(target, shape, fmt) for fmt in candidates}))
    for name, m in planned_experts(model).items():
        if name not in rows:
            continue
        excluded = {fmt: EXPERTS_EXCLUDED if fmt in target.kernels else f"no {fmt} kernel on {target.name}"
                    for fmt in LOW_FORMATS if fmt != "current"}
        candidates = ("bf16", "current")        # every target runs per-tensor fp8
        shape, parts, costs = experts_costs(name, m, rows[name], target, candidates)
        out.append(PlanLayer(name, shape, candidates, excluded, costs, parts))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return tuple(sorted(out, key=lambda lay: order[lay.name]))

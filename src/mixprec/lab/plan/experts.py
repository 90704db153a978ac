"""A mixture of experts' grouped GEMMs as plan candidates: their rows, costs and one-step evidence.

A Hugging Face experts module (``fp8/experts.py``) multiplies two projections as grouped GEMMs, and
per-tensor fp8 (``current``) is the one scaling they take; the swap takes both projections or neither.
So the plan treats an experts module as one unit: its cost on the target is the sum of its two
projections' (``LinearShape(groups=experts)``: every expert's weight is read and cast each step), and
its one-step evidence is measured at the module. On bf16's last lockstep step ``ExpertsCapture`` keeps
the module's inputs (hidden states, the router's choices and weights) and its output gradient; then a
bf16 copy and a per-tensor fp8 copy of the module run forward and backward on them, under the bf16
autocast the recipe runs them in::

    sqnr_out    = SQNR(fp8 module output, bf16 module output)
    sqnr_grad_w = min over the projections of SQNR(fp8 weight gradient, bf16 weight gradient)

the what-if's two measures (``doctor/what_if.py``), at the module rather than one GEMM: the routing, the
gate and the activation between the two GEMMs count. Per-tensor scales come from each tensor's own amax,
so nothing saturates. The end-to-end gradient SNR (``evidence.gradient_snr``) covers the module too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import nn

from ...diagnostics.speed_model import LinearCost, LinearShape, Target, linear_cost
from ...fp8.experts import experts_blocker, expert_projections, is_hf_experts, to_fp8_experts
from ...recipe import Fp8Config, Fp8Scaling
from ..doctor.what_if import sqnr_db

__all__ = ["EXPERTS_FORMATS", "EXPERTS_EXCLUDED", "planned_experts", "projection_names", "experts_rows_hook",
           "experts_costs", "ExpertsCapture"]

# The formats a grouped expert GEMM runs in (fp8/swap.py refuses blocked scalings for experts).
EXPERTS_FORMATS = ("bf16", "current")
EXPERTS_EXCLUDED = "grouped expert GEMMs take per-tensor scaling only"


def planned_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules the fp8 swap could run as grouped fp8 GEMMs, by name, in module order."""
    return {name: m for name, m in model.named_modules() if name and is_hf_experts(m) and experts_blocker(m) is None}


def projection_names(name: str, module: nn.Module) -> tuple[str, ...]:
    """``name.gate_up_proj`` (or ``name.up_proj``) and ``name.down_proj``: the names skip= takes."""
    return tuple(f"{name}.{proj}" for proj, *_ in expert_projections(module))


def experts_rows_hook(name: str, rows: dict[str, int]):
    """A forward hook adding the routed rows (tokens x top k) of one call to ``rows[name]``."""
    def record(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if isinstance(index, torch.Tensor):
            rows[name] = rows.get(name, 0) + index.numel()
    return record


def experts_costs(name: str, module: nn.Module, rows: int, target: Target, formats: tuple[str, ...]
                  ) -> tuple[LinearShape, tuple[LinearShape, ...], dict[str, LinearCost]]:
    """The module's two projections as one shape (FLOPs of both), each projection's shape (named as
    skip= takes it), and the module's cost per format on ``target``."""
    shapes = [LinearShape(f"{name}.{proj}", rows, n, k, groups=e) for proj, e, n, k in expert_projections(module)]
    costs = {}
    for fmt in formats:
        parts = [linear_cost(target, s, fmt) for s in shapes]
        costs[fmt] = LinearCost(fmt, sum(p.gemm_s for p in parts), sum(p.cast_s for p in parts),
                                sum(p.bytes for p in parts))
    # One shape whose FLOPs are both projections': rows x (n1 k1 + n2 k2) as rows x n x k with k = 1.
    total = LinearShape(name, rows, sum(s.n * s.k for s in shapes), 1, groups=shapes[0].groups)
    return total, tuple(shapes), costs


@dataclasses.dataclass
class _Captured:
    args: tuple
    kwargs: dict
    grad: torch.Tensor | None = None


class ExpertsCapture:
    """Keep each experts module's inputs and output gradient over one forward and backward; then
    ``evidence()`` measures a per-tensor fp8 copy of each module against a bf16 copy on them."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = planned_experts(model)
        self.captured: dict[str, _Captured] = {}

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        handles = [m.register_forward_hook(self._hook(n), with_kwargs=True) for n, m in self.modules.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if name in self.captured or not isinstance(output, torch.Tensor):
                return                                      # the first call of the step is measured
            entry = _Captured(tuple(_detached(a) for a in args), {k: _detached(v) for k, v in kwargs.items()})
            self.captured[name] = entry
            if output.requires_grad:
                output.register_hook(lambda g: setattr(entry, "grad", g.detach().clone()))
        return hook

    def evidence(self) -> dict:
        """Per captured module (whose output got a gradient): per-tensor fp8's evidence against bf16."""
        return {name: _measure(self.modules[name], c) for name, c in self.captured.items() if c.grad is not None}


def _detached(v: object) -> object:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _run(module: nn.Module, c: _Captured) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The module's output and its projections' weight gradients (fp32) for the captured step."""
    device = c.grad.device
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = module(*c.args, **c.kwargs)
    out.backward(c.grad.to(out.dtype))
    grads = []
    for proj, *_ in expert_projections(module):
        g = getattr(module, proj).grad
        grads.append(torch.zeros_like(getattr(module, proj)) if g is None else g.float())
    return out.detach().float(), grads


def _measure(module: nn.Module, c: _Captured):
    from .choose import LayerEvidence            # choose imports candidates, which imports this module
    with torch.random.fork_rng(devices=[c.grad.device] if c.grad.device.type == "cuda" else []):
        bf16 = copy.deepcopy(module)
        fp8 = copy.deepcopy(module)
        to_fp8_experts(fp8, Fp8Config(scaling=Fp8Scaling.CURRENT))
        for m in (bf16, fp8):
            m.train(module.training)
            for p in m.parameters():
                p.grad = None
        y_ref, g_ref = _run(bf16, c)
        y, g = _run(fp8, c)
    values = torch.stack([sqnr_db(y_ref, y)] + [sqnr_db(r, t) for r, t in zip(g_ref, g)]).cpu().tolist()
    nan_to_fail = [v if not math.isnan(v) else -math.inf for v in values]
    return LayerEvidence("current", nan_to_fail[0], min(nan_to_fail[1:]), 0.0)

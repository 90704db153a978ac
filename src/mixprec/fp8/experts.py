"""A mixture of experts' 3-D expert weights in fp8: Hugging Face experts modules run grouped fp8 GEMMs.

Hugging Face transformers (5.x) keeps a mixture of experts' weights as 3-D Parameters in one module
per layer, declared through its ``use_experts_implementation`` interface (Mixtral, Qwen2-MoE,
DeepSeek, GPT-OSS, ...): ``gate_up_proj`` (experts, 2 x intermediate, hidden), or ``up_proj`` without
a gate, and ``down_proj`` (experts, hidden, intermediate); stored the other way round when
``is_transposed``; biases ``<name>_bias`` when ``has_bias``. ``is_hf_experts`` recognizes such a module
by those attributes (mixprec does not import transformers). ``to_fp8_experts`` gives it one
``Fp8GroupedLinear`` per projection (``gate_up_proj_fp8``, ``down_proj_fp8``: scale state only, no
parameters, so ``state_dict()`` keys stay the model's) and a forward that routes through them::

    rows sorted by expert -> offsets -> up projection (fp8) -> the module's own gate / activation
    -> down projection (fp8) -> routing weights -> back to token order, summed over the top k

The gate (``_apply_gate``), activation and optional post-expert norm are the module's own, so a model
with a custom gate keeps it. Numbers: each GEMM as ``Fp8GroupedLinear`` computes it; the rest as HF's
``grouped_mm`` experts implementation does (a sum over the top k in the activations' dtype, like it).

A module this cannot run keeps its forward, and the fp8 report says why (``experts_blocker``):
expert parallelism (sentinel rows), or dimensions that are not multiples of 16.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..devices import probe_fp8_kernel
from ..recipe.fp8 import Fp8Config
from .grouped import Fp8GroupedLinear

__all__ = ["is_hf_experts", "expert_projections", "experts_blocker", "grouped_backend", "to_fp8_experts"]

_ALIGN = 16


def is_hf_experts(module: nn.Module) -> bool:
    """True for a transformers experts module (``use_experts_implementation``) with 3-D weights."""
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts", "act_fn")):
        return False
    names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    return all(isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).dim() == 3 for n in names)


def expert_projections(module: nn.Module) -> list[tuple[str, int, int, int]]:
    """``(parameter name, experts, out, in)`` of the up (or gate-up) and down projections."""
    out = []
    for name in ("gate_up_proj" if module.has_gate else "up_proj", "down_proj"):
        e, a, b = getattr(module, name).shape
        out.append((name, e, b, a) if module.is_transposed else (name, e, a, b))
    return out


def experts_blocker(module: nn.Module) -> str | None:
    """Why ``module``'s experts cannot run in fp8 here, or None when they can."""
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallel (sentinel rows for remote experts): grouped fp8 runs unsharded experts only"
    for name, _, out_f, in_f in expert_projections(module):
        if out_f % _ALIGN or in_f % _ALIGN:
            return (f"{name} is (out, in) = ({out_f}, {in_f}) per expert: fp8 GEMMs need both dimensions "
                    f"to be multiples of {_ALIGN}")
    return None


def grouped_backend(module: nn.Module, backend: str) -> str:
    """The backend of ``module``'s grouped GEMMs: ``scaled_mm`` where the layers' backend is and the
    device runs ``torch._scaled_grouped_mm`` (Hopper), else ``emulate``."""
    if backend != "scaled_mm":
        return "emulate"
    return "scaled_mm" if probe_fp8_kernel("grouped", module.down_proj.device).ok else "emulate"


def to_fp8_experts(module: nn.Module, config: Fp8Config, backend: str = "emulate") -> None:
    """Give ``module`` its fp8 grouped projections and the forward that uses them (in place);
    ``backend`` is ``grouped_backend``'s answer."""
    device = module.down_proj.device
    for name, experts, out_f, in_f in expert_projections(module):
        layer = Fp8GroupedLinear(experts, out_f, in_f, config, backend=backend, device=device)
        layer.train(module.training)
        setattr(module, f"{name}_fp8", layer)
    # An instance attribute: nn.Module.__call__ finds it before the class's (interface-dispatching) forward.
    module.forward = types.MethodType(_fp8_experts_forward, module)


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    """The projection's weight as (experts, out, in): a view when the module stores it transposed."""
    w = getattr(module, name)
    return w.transpose(1, 2) if module.is_transposed else w


def _fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward with both projections as fp8 grouped GEMMs: hidden_states (T, H), top_k_index
    and top_k_weights (T, k) -> (T, H), as the module's own forward returns it."""
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    expert, order = torch.sort(top_k_index.reshape(-1), stable=True)         # (S,) routed rows by expert
    x = hidden_states[order // k]                                            # (S, H)
    # Rows per expert without a host sync or a data-dependent shape: a (S, E) comparison, summed.
    per_expert = (expert[:, None] == torch.arange(self.num_experts, device=expert.device)).sum(0)
    offs = per_expert.cumsum(0).to(torch.int32)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    y = getattr(self, f"{up}_fp8")(x, _weight(self, up), offs)
    if self.has_bias:
        y = y + getattr(self, f"{up}_bias")[expert]
    y = self._apply_gate(y) if self.has_gate else self.act_fn(y)
    y = self.down_proj_fp8(y, _weight(self, "down_proj"), offs)
    if self.has_bias:
        y = y + self.down_proj_bias[expert]
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[order, None]
    # Back to token order (row t * k + j is token t's j-th expert), then the sum over the top k.
    out = y.new_zeros(tokens * k, hidden).index_copy(0, order, y)
    return out.view(tokens, k, hidden).sum(1).to(hidden_states.dtype)

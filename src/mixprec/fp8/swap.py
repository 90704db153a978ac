"""Which ``nn.Linear`` layers become fp8, and the swap itself; the typed report of every decision it
answers with is ``swap_report.py``'s.

A layer is swapped for an ``Fp8Linear`` when it is exactly ``nn.Linear`` (subclasses have forwards of
their own) or Hugging Face's ``Conv1D`` (GPT-2's linear with a transposed weight, swapped for an
``Fp8Conv1D``: fp8/conv1d.py), both weight dimensions are multiples of 16 (fp8 tensor-core GEMMs
need it), and nothing excludes it: a ``skip`` glob on its qualified name, ``skip_first``/``skip_last`` (the first/last
``nn.Linear`` in module registration order), a user ``filter(name, module) -> bool``, or a pure
recipe's ``fp32_modules``. ``force`` names layers that must be fp8: an error if one cannot be::

    report = swap_to_fp8(model, Fp8Config(skip=("lm_head",)), backend="emulate")
    print(report)            # one line per linear: name, shape, fp8 or why not
    report.swapped           # ('blocks.0.attn.c_attn', ...)
    report.uncovered         # the other weights no fp8 layer computes with, and why

A mixture of experts' 3-D expert weights in a Hugging Face experts module (Mixtral's ``gate_up_proj``,
``(experts, 2 x intermediate, hidden)``, most of such a model's parameters) become fp8 grouped GEMMs
under per-tensor fp8 (fp8/experts.py); each projection is one line of the report, its shape per expert
and ``groups`` the number of experts. ``skip``, ``fp8_filter`` and ``force`` take those names too
(``model.layers.0.mlp.experts.down_proj``); excluding either projection keeps the module's experts out.
The report also names every other weight (a parameter of 2 or more dimensions) that stays in the base
recipe: embeddings, convolutions, and weights a module multiplies in its own forward (a router, or
a custom mixture of experts' weights).
"""

from __future__ import annotations

import difflib
import fnmatch
import zlib
from collections.abc import Callable

import torch
from torch import nn

from ..recipe.fp8 import Fp8Config
from .backends import backend_per_scaling, resolve_backend, resolve_backends
from .conv1d import Fp8Conv1D, is_hf_conv1d
from .experts import expert_projections, experts_blocker, grouped_backend, is_hf_experts, to_fp8_experts
from .layer_state import Fp8LayerState
from .fsdp_weight import fp8_in_place, unsharded_class
from .linear import Fp8Linear
from .swap_report import (FORMAT_WORDS, Fp8LayerDecision, Fp8Reason, Fp8SwapReport, Fp8UncoveredWeight,
                          none_swapped_reason)

# The report's names (swap_report.py) and the backends' (backends.py) stay importable from here, where
# they were defined or exported before.
__all__ = ["Fp8Reason", "Fp8LayerDecision", "Fp8UncoveredWeight", "Fp8SwapReport", "swap_to_fp8",
           "resolve_backend", "resolve_backends", "check_fp8_patterns", "none_swapped_reason",
           "shape_takes_fp8", "padded_shape"]

_ALIGN = 16


def shape_takes_fp8(out_features: int, in_features: int) -> bool:
    """Whether the swap can take a linear of weight shape ``(out, in)``: both multiples of 16 (fp8 GEMMs)."""
    return out_features % _ALIGN == 0 and in_features % _ALIGN == 0


def padded_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """``(out, in)`` rounded up to the swap's multiples of 16: the shape to pad a layer to."""
    return -(-out_features // _ALIGN) * _ALIGN, -(-in_features // _ALIGN) * _ALIGN


def swap_to_fp8(model: nn.Module, config: Fp8Config, *, backend: str | dict, note: str = "",
                filter: Callable[[str, nn.Module], bool] | None = None,
                keeps_fp32: Callable[[nn.Module], bool] | None = None) -> Fp8SwapReport:
    """Replace eligible ``nn.Linear`` modules of ``model`` in place; return the report of every linear.

    ``filter(name, module)`` returning False keeps a layer out; ``keeps_fp32(module)`` True means the
    recipe keeps it fp32. ``backend``: one word for every layer, or ``{Fp8Scaling: word}`` (what
    ``resolve_backends`` returns) when ``layers=`` rules give layers scalings of their own; each layer is
    built with ``config.for_layer(name)``. ValueError for a forced layer that does not exist or cannot be fp8 (its
    shape is named). Parameters are shared, not copied.
    """
    if filter is not None and not callable(filter):
        raise TypeError(f"fp8_filter must be a function filter(name, module) -> bool that returns False "
                        f"for layers to keep out of fp8, or None; got {filter!r}")
    linears = check_fp8_patterns(model, config)
    backends = backend_per_scaling(config, backend)
    backend = "+".join(dict.fromkeys(backends.values()))   # the report's word: "emulate+scaled_mm" if mixed
    decisions, replace = [], {}
    where = {name: i for i, (name, _) in enumerate(model.named_modules())}
    for i, (name, module) in enumerate(linears):
        out_f, in_f = _out_in(module)
        reason, detail = _decide(i, len(linears), name, module, config, filter, keeps_fp32)
        if reason is Fp8Reason.FORCED and not _swappable(module) and not isinstance(module, Fp8LayerState):
            raise ValueError(f"fp8 forced on {name!r}, a {type(module).__name__}: only plain nn.Linear "
                             "layers and HF Conv1D can be swapped (a subclass's forward would be lost)")
        if reason is Fp8Reason.FORCED and not shape_takes_fp8(out_f, in_f):
            raise ValueError(
                f"fp8 forced on {name!r}, an nn.Linear with weight shape ({out_f}, {in_f}) (out, in): fp8 "
                f"matmuls need both dimensions to be multiples of {_ALIGN}; pad the layer (e.g. to "
                f"{padded_shape(out_f, in_f)}) or drop it from force=")
        if isinstance(module, Fp8LayerState):
            detail = getattr(module, "fp8_gather_note", "") or detail    # swapped by shard_model
        elif reason in (Fp8Reason.SWAPPED, Fp8Reason.FORCED) and getattr(module, "_is_fsdp_managed_module", False):
            # FSDP2 holds this very module (its hooks swap the gathered weight in): change its class
            # in place instead of replacing it. Its weight is gathered in the recipe's dtype and cast
            # here; shard_model(model, recipe) swaps before sharding and gathers in e4m3.
            own = config.for_layer(name)
            fp8_in_place(module, own, backends[own.scaling])
            module.reseed(zlib.crc32(name.encode()))
            detail = "weight all-gathered unscaled by your fully_shard, cast per step (shard_model gathers e4m3)"
        elif reason in (Fp8Reason.SWAPPED, Fp8Reason.FORCED):
            own = config.for_layer(name)         # its ``layers=`` rule's scaling, else the leading one
            kernel = backends[own.scaling]
            layer = (Fp8Conv1D.from_conv1d(module, own, kernel) if is_hf_conv1d(module)
                     else Fp8Linear.from_linear(module, own, kernel))
            # nvfp4's noise and Hadamard signs differ layer to layer and stay the same run to run.
            layer.reseed(zlib.crc32(name.encode()))
            replace[id(module)] = layer
            if own.blocked or config.layers:
                detail = FORMAT_WORDS[own.scaling.value]        # the report names the format per layer
        decisions.append(Fp8LayerDecision(name, out_f, in_f, reason, detail))
    covered = {id(m.weight) for _, m in linears}
    for name, module in _experts(model):
        outer = backends[config.scaling_for(name)]
        kernel = grouped_backend(module, outer)
        decisions.extend(_experts_decisions(name, module, config, filter, keeps_fp32,
                                            emulated=outer == "scaled_mm" and kernel == "emulate"))
        if decisions[-1].swapped:
            to_fp8_experts(module, config.for_layer(name), kernel)
        # The decisions name these weights, and their biases go with them.
        covered.update(id(p) for p in module.parameters(recurse=False))
    # Module order: a linear by its own name, an expert projection (a parameter) by its module's.
    decisions.sort(key=lambda d: where.get(d.name, where.get(d.name.rpartition(".")[0])))
    uncovered = _uncovered(model, covered)
    parameters = sum(p.numel() for p in model.parameters())     # parameters() yields a shared one once
    # Replace every reference (a module shared by two parents is swapped in both).
    for parent in model.modules():
        for child_name, child in list(parent.named_children()):
            if id(child) in replace:
                setattr(parent, child_name, replace[id(child)])
    return Fp8SwapReport(tuple(decisions), backend, note, uncovered, parameters)


def _experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's Hugging Face experts modules (3-D expert weights), in module order."""
    return [(n, m) for n, m in model.named_modules() if n and is_hf_experts(m)]


def _experts_decisions(name: str, module: nn.Module, config: Fp8Config,
                       filter: Callable[[str, nn.Module], bool] | None,
                       keeps_fp32: Callable[[nn.Module], bool] | None, emulated: bool) -> list[Fp8LayerDecision]:
    """One decision per projection of an experts module; both swapped or neither (one forward runs both).
    ``emulated``: the other layers run fp8 kernels but this device has no grouped one."""
    projections = expert_projections(module)
    names = [f"{name}.{p}" for p, *_ in projections]
    reason, detail = Fp8Reason.SWAPPED, f"grouped GEMM over {projections[0][1]} experts"
    if emulated:
        detail += ", emulated (no grouped fp8 kernel on this device)"
    blocker = experts_blocker(module)
    pattern = next((p for p in config.skip for n in names if fnmatch.fnmatchcase(n, p)), None)
    scaling = next((s for s in map(config.scaling_for, names) if s.blocked), config.scaling_for(name))
    if scaling.blocked:
        reason, detail = Fp8Reason.SCALING, f"fp8={scaling.value} covers nn.Linear layers"
    elif blocker is not None:
        reason, detail = Fp8Reason.EXPERTS, blocker
    elif keeps_fp32 is not None and keeps_fp32(module):
        reason, detail = Fp8Reason.FP32, ""
    elif pattern is not None:
        reason, detail = Fp8Reason.SKIP, pattern
    elif filter is not None and not all(filter(n, module) for n in names):
        reason, detail = Fp8Reason.FILTER, ""
    elif any(n in config.force for n in names):
        reason = Fp8Reason.FORCED
    forced = [n for n in names if n in config.force]
    if forced and reason not in (Fp8Reason.SWAPPED, Fp8Reason.FORCED):
        raise ValueError(f"fp8 forced on {forced[0]!r}, a grouped expert GEMM that cannot be fp8: "
                         f"{reason.value}" + (f" ({detail})" if detail else "") + "; drop it from force=")
    return [Fp8LayerDecision(n, out_f, in_f, reason, detail, groups=e)
            for n, (_, e, out_f, in_f) in zip(names, projections)]


def _uncovered(model: nn.Module, linear_weights: set[int]) -> tuple[Fp8UncoveredWeight, ...]:
    """Every parameter of 2+ dimensions that no linear layer holds (those are in the layer decisions;
    a weight tied to a linear's, like GPT-2's embedding, counts as that linear's), with the reason."""
    out, seen = [], set(linear_weights)
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            if p.dim() < 2 or id(p) in seen:
                continue         # biases and norm scales multiply elementwise: no matmul to cover
            seen.add(id(p))
            name = f"{module_name}.{param_name}" if module_name else param_name
            out.append(Fp8UncoveredWeight(name, tuple(p.shape), _why_uncovered(module, p)))
    return tuple(out)


def _why_uncovered(module: nn.Module, p: torch.Tensor) -> str:
    owner = type(module).__name__
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "an embedding: a lookup, no matmul"
    if isinstance(module, nn.modules.conv._ConvNd):
        return f"a convolution ({owner}): fp8 covers linear layers only"
    if p.dim() >= 3:
        return (f"{p.dim()}-D, multiplied in {owner}.forward (per-expert or batched matmuls): fp8 "
                "covers linear layers only")
    return f"multiplied in {owner}.forward, not an nn.Linear: fp8 covers linear layers only"


def check_fp8_patterns(model: nn.Module, config: Fp8Config) -> list[tuple[str, nn.Module]]:
    """ValueError for a ``force`` name or a ``skip`` glob that names no linear of ``model`` (a typo would
    leave the layer in fp8); returns the linears ``(name, module)`` in module order. Changes nothing."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_hf_conv1d(m)]
    names = [n for n, _ in linears] + [f"{n}.{p}" for n, m in _experts(model) for p, *_ in expert_projections(m)]
    for name in config.force:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            raise ValueError(f"fp8 force={name!r}: the model has no nn.Linear of that name"
                             + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                                f"; its linears are: {', '.join(names) or 'none'}"))
    for pattern, scaling in config.layers:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            close = difflib.get_close_matches(pattern, names, n=3)
            raise ValueError(f"fp8 layers={pattern}:{scaling.value} matches no nn.Linear of {type(model).__name__} "
                             "(rules take fnmatch globs over qualified names, e.g. blocks.*.mlp.c_fc)"
                             + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                                f"; its linears are: {', '.join(names[:8]) or 'none'}"))
    for pattern in config.skip:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            close = difflib.get_close_matches(pattern, names, n=3)
            raise ValueError(f"fp8 skip={pattern!r} matches no nn.Linear of {type(model).__name__} (skip takes "
                             "fnmatch globs over qualified names, e.g. blocks.*.attn.c_proj)"
                             + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                                f"; its linears are: {', '.join(names[:8]) or 'none'}"))
    return linears


def _decide(i: int, n: int, name: str, module: nn.Module, config: Fp8Config,
            filter: Callable[[str, nn.Module], bool] | None,
            keeps_fp32: Callable[[nn.Module], bool] | None) -> tuple[Fp8Reason, str]:
    out_f, in_f = _out_in(module)
    if name == "":
        return Fp8Reason.ROOT, ""
    if isinstance(module, Fp8LayerState):           # already fp8 (shard_model swapped it)
        if module.fp8_config != config.for_layer(name):     # its own layers= rule's format, if any
            raise ValueError(f"{name!r} is already an fp8 layer with fp8={module.fp8_config}, but the recipe "
                             f"says fp8={config.for_layer(name)} for it: shard the model with the recipe you "
                             "train with")
        return (Fp8Reason.FORCED if name in config.force else Fp8Reason.SWAPPED), ""
    if name in config.force:
        return Fp8Reason.FORCED, ""
    if not _swappable(module):
        return Fp8Reason.SUBCLASS, type(module).__name__
    if keeps_fp32 is not None and keeps_fp32(module):
        return Fp8Reason.FP32, ""
    pattern = next((p for p in config.skip if fnmatch.fnmatchcase(name, p)), None)
    if pattern is not None:
        return Fp8Reason.SKIP, pattern
    if config.skip_first and i == 0:
        return Fp8Reason.FIRST, ""
    if config.skip_last and i == n - 1:
        return Fp8Reason.LAST, ""
    if filter is not None and not filter(name, module):
        return Fp8Reason.FILTER, ""
    if not shape_takes_fp8(out_f, in_f):
        return Fp8Reason.SHAPE, f"pad to {padded_shape(out_f, in_f)}"
    return Fp8Reason.SWAPPED, ""


def _out_in(module: nn.Module) -> tuple[int, int]:
    """``(out, in)`` features: nn.Linear stores its weight (out, in), HF Conv1D (in, out)."""
    out_f, in_f = module.weight.shape
    return (in_f, out_f) if is_hf_conv1d(module) else (out_f, in_f)


def _swappable(module: nn.Module) -> bool:
    # Exactly nn.Linear (a subclass has a forward of its own), or HF's Conv1D (a linear with a
    # transposed weight: fp8/conv1d.py). FSDP2's fully_shard gives a module the class
    # FSDP<cls>(FSDPModule, cls), which adds hooks and no forward: that is judged by cls.
    cls = unsharded_class(module)
    if getattr(module, "_is_fsdp_managed_module", False):
        return cls is nn.Linear          # changed in place (fp8_in_place): Conv1D's layout is not handled there
    return cls is nn.Linear or is_hf_conv1d(module)


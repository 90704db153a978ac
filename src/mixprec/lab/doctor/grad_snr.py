"""End-to-end gradient SNR: what one step's local SQNR misses (issue 35).

The what-if's SQNR quantizes one layer's own GEMM against bf16 on exact inputs. In training every layer
quantizes at once: the forward's errors change the activations and the gradients that reach each layer,
and the backward's compound on the way down. And the gradient shrinks as the loss falls while the
quantization error does not, so a format that is 20+ dB from the reference at the start can bury the
signal later. This module measures that directly, per linear layer: run the whole model under each
format and under fp32 from the same weights on the same batch, and compare each weight's gradient::

    snr  = |g| / |g_f - g|               (g: fp32's gradient, g_f: the format's; inf when equal)
    sign = sum(|g| [sign g_f == sign g]) / sum(|g|)      (the share of the gradient pointing the same way)

Below ``SNR_FLOOR = sqrt(3)`` the quantization error outweighs the gradient (the threshold proposed for
FP4 training, Chmiel et al. 2025). On the char GPT of ``benchmarks/quality/train_quality.py`` (RESULTS.md, issue
35) the smallest per-layer SNR along a run falls from 23 to 2.5 for the fp8 formats (rowwise and mxfp8
alike, to 0.1) and from 5.5 to 0.6 for nvfp4, which crosses sqrt(3) where it leaves fp32's seed band.

    snr = gradient_snr(build_model, model.state_dict(), lambda m: loss_fn(m(x), y), ["fp8", "nvfp4"],
                       layers=["blocks.0.mlp.c_fc", ...])
    snr["blocks.0.mlp.c_fc"]["nvfp4"]        # GradSnr(snr=..., sign=...)

Cost: one forward and backward in fp32 plus one per format, on fresh copies of the model (the user's
model, its gradients and the random state are untouched). One host sync per format.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ...engine import Fp8EmulationWarning, MixedPrecision
from ...fp8.experts import expert_projections, is_hf_experts
from ...loss_scale.scales import NoLossScale
from .what_if_report import GRAD_SNR_FLOOR, WhatIfReport

__all__ = ["SNR_FLOOR", "GradSnr", "gradient_snr", "snr_and_sign", "with_grad_snr"]

SNR_FLOOR = GRAD_SNR_FLOOR   # sqrt(3): below it the quantization error outweighs the gradient


@dataclasses.dataclass(frozen=True)
class GradSnr:
    """One layer's weight gradient under one format against fp32's: ``snr`` (inf: equal) and ``sign``."""

    snr: float
    sign: float

    @property
    def below_floor(self) -> bool:
        """True when ``snr < SNR_FLOOR`` (NaN: unknown, not below)."""
        return self.snr < SNR_FLOOR


def snr_and_sign(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """``[|ref| / |test - ref|, |ref|-weighted sign agreement]`` as a float64 tensor (no host sync)."""
    r, t = ref.detach().to(torch.float64), test.detach().to(torch.float64)
    noise = torch.linalg.vector_norm(t - r)
    signal = torch.linalg.vector_norm(r)
    snr = torch.where(noise == 0, torch.full_like(signal, math.inf), signal / noise)
    w = r.abs()
    sign = torch.where(w.sum() > 0, (w * (torch.sign(t) == torch.sign(r))).sum() / w.sum(), 1.0)
    return torch.stack([snr, sign])


def _weight_grads(build_model: Callable[[], nn.Module], state: Mapping[str, torch.Tensor], recipe: str,
                  loss: Callable[[nn.Module], torch.Tensor], layers: Sequence[str], device: torch.device,
                  seed: int, fp8_layers: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = build_model().to(device)
        model.load_state_dict(state)           # fp32 parameters: a pure recipe's low-precision values, cast
        model.train()
        with warnings.catch_warnings():        # the user runs none of these recipes: no notice of their
            warnings.simplefilter("ignore", Fp8EmulationWarning)              # emulation on this device
            only = None if fp8_layers is None else (lambda name, _m, keep=frozenset(fp8_layers): name in keep)
            mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe, seed=seed,
                                fp8_filter=only if recipe != "fp32" else None)
        torch.manual_seed(seed)                # dropout and the like draw the same for every format
        with mp.autocast():
            out = loss(model)
        mp.backward(out)
    modules = dict(model.named_modules())
    inv = None if isinstance(mp.loss_scale, NoLossScale) else mp.loss_scale.value.reciprocal()
    grads = {}
    for name in layers:
        g = _layer_grad(modules[name])
        grads[name] = g * inv if inv is not None else g     # true units: 1/S is a power of two
    return grads


def _layer_grad(module: nn.Module) -> torch.Tensor:
    """A linear's weight gradient in fp32 (zeros when it got none); an experts module's two projections'
    gradients, flattened end to end."""
    weights = ([getattr(module, p) for p, *_ in expert_projections(module)] if is_hf_experts(module)
               else [module.weight])
    grads = [torch.zeros_like(w, dtype=torch.float32) if w.grad is None else w.grad.to(torch.float32)
             for w in weights]
    return grads[0] if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])


@torch.no_grad()
def _compare(ref: dict[str, torch.Tensor], test: dict[str, torch.Tensor]) -> dict[str, GradSnr]:
    values = torch.stack([snr_and_sign(ref[n], test[n]) for n in ref]).cpu().tolist()   # one sync
    return {n: GradSnr(snr=v[0], sign=v[1]) for n, v in zip(ref, values)}


def gradient_snr(build_model: Callable[[], nn.Module], state: Mapping[str, torch.Tensor],
                 loss: Callable[[nn.Module], torch.Tensor], formats: Sequence[str], *, layers: Sequence[str],
                 device: str | torch.device = "cpu", seed: int = 0,
                 fp8_layers: Sequence[str] | None = None) -> dict[str, dict[str, GradSnr]]:
    """Per layer (qualified names of linear layers) and format (recipe names): the weight gradient's
    end-to-end SNR and sign agreement against fp32, the whole model run under the format.

    ``build_model()`` makes a fresh model of the same architecture; ``state`` its weights (a
    ``state_dict``; an fp8 model's keys are nn.Linear's); ``loss(model)`` runs the batch and returns the
    loss (called inside the recipe's autocast). ``fp8_layers``: only these linears take the format's
    fp8 (the others stay in the recipe's base precision), as a plan that keeps some layers in bf16 runs.
    """
    if not layers:
        raise ValueError("gradient_snr needs the names of the linear layers to compare (layers=[...])")
    device = torch.device(device)
    ref = _weight_grads(build_model, state, "fp32", loss, layers, device, seed)
    return_: dict[str, dict[str, GradSnr]] = {n: {} for n in layers}
    for fmt in formats:
        test = _weight_grads(build_model, state, fmt, loss, layers, device, seed, fp8_layers)
        for name, r in _compare(ref, test).items():
            return_[name][fmt] = r
    return return_


def with_grad_snr(report: WhatIfReport, snr: Mapping[str, Mapping[str, GradSnr]]) -> WhatIfReport:
    """``report`` with each layer's formats carrying their ``grad_snr``/``grad_sign`` from ``snr``
    (layers or formats missing from ``snr`` keep NaN: not measured)."""
    layers = []
    for layer in report.layers:
        mine = snr.get(layer.name, {})
        formats = tuple(dataclasses.replace(r, grad_snr=mine[r.format].snr, grad_sign=mine[r.format].sign)
                        if r.format in mine else r for r in layer.formats)
        layers.append(dataclasses.replace(layer, formats=formats))
    return dataclasses.replace(report, layers=tuple(layers))

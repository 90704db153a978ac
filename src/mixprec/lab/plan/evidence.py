"""The plan's evidence: short lockstep trainings from one init, fp32's seed band, and the per-layer what-if.

**Lockstep.** ``lockstep`` trains a workload under a recipe exactly as ``lab/trainer.train`` does (the
model built under ``torch.manual_seed(seed)``, the batches in ``batch_order(seed)``, ``MixedPrecision(...,
seed=seed)``, the same loss), without its evaluation and timing: two recipes run from the same weights
on the same batches, so their loss curves differ by what the recipes do, and a recipe string trains
bit for bit as it trained here (``tests/test_plan.py`` checks that against ``train``).

**The band.** fp32 trained from two seeds (``seed`` and ``seed + 1``: other weights, other batch order)
ends its short run at two different losses; that spread, ``|tail(a) - tail(b)|`` over the last quarter
of the steps, is how much a loss can move for no reason of precision on this workload and horizon. A
plan is accepted when its tail is within ``budget x band`` of bf16's (lockstep, same seed).

**One-step evidence.** On bf16's last lockstep step the doctor's what-if (``doctor/what_if.py``) measures
each linear's output and weight-gradient SQNR under every format on that step's own operands.

**Long-horizon evidence.** One-step local SQNR misses harm that accumulates, so nothing is accepted
without a lockstep verification. Before it, ``gradient_snr`` measures per layer the end-to-end
weight-gradient SNR of each format against fp32 (the whole model run in the format, same weights and
batch): the MXFP8 issue found it separates the recipe that leaves fp32's band (nvfp4: it falls through
sqrt(3) as the run leaves the band) from those that stay (fp8 per-tensor, rowwise, mxfp8: equal to
0.1), where every local SQNR read 20+ dB. ``LayerMeasure`` functions add further per-layer evidence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ...diagnostics.memory import SavedTensorMeter
from ...engine import MixedPrecision
from ...model_io import predictions
from ...recipe import Recipe, get_recipe
from ..doctor.grad_snr import SNR_FLOOR
from ..doctor.grad_snr import gradient_snr as doctor_gradient_snr
from ..doctor.what_if import WhatIfCapture
from ..doctor.what_if_report import LayerWhatIf
from ..trainer import batch_order
from ..workloads import Workload
from .experts import ExpertsCapture

__all__ = ["Lockstep", "lockstep", "tail", "Band", "fp32_band", "WorkloadDiverges", "LayerMeasure", "gradient_snr",
           "GRAD_SNR_THRESHOLD", "capture_what_if"]

_TAIL = 0.25            # the tail is the mean loss over the last quarter of the steps
# A plan trains at most this many times bf16's loss drop worse than the band allows: the band has a
# floor of this share of the drop (two fp32 seeds that happen to end together must not make the band 0).
_BAND_FLOOR = 0.005

# A per-layer measure beyond the SQNR: (the layer's what-if, format) -> (value, passes). The finding of
# the MXFP8 issue plugs in here.
LayerMeasure = Callable[[LayerWhatIf, str], "tuple[float, bool]"]


class WorkloadDiverges(ValueError):
    """The workload does not train in fp32 over the plan's steps: there is no band to plan inside."""


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """One lockstep run: the loss before each step's update, and the bytes autograd saved on step 0."""

    recipe: str
    losses: tuple[float, ...]
    saved_bytes: int

    @property
    def tail(self) -> float:
        return tail(self.losses)


def tail(losses: tuple[float, ...]) -> float:
    """Mean loss over the last quarter of the steps (at least one)."""
    n = max(1, round(len(losses) * _TAIL))
    return math.fsum(losses[-n:]) / n


def lockstep(workload: Workload, recipe: str | Recipe, *, steps: int, seed: int, device: torch.device,
             last_step: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None,
             first_step: Callable[[MixedPrecision], None] | None = None) -> Lockstep:
    """Train ``steps`` steps as ``trainer.train`` would; ``last_step(model)`` wraps the last forward and
    backward (the what-if capture), ``first_step(mp)`` runs before the first (a speed profile)."""
    recipe = get_recipe(recipe)
    data = workload.load_data().to(device)
    order = batch_order(len(data.y_train), workload.batch_size, steps, seed).to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = workload.build_model()
    model.to(device)
    optimizer = workload.make_optimizer(model.parameters())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*emulated.*")      # the plan says it once itself
        mp = MixedPrecision(model, optimizer, recipe, seed=seed)
    if first_step is not None:
        first_step(mp)
    model.train()
    losses, saved = [], 0
    for step in range(steps):
        idx = order[step]
        meter = SavedTensorMeter(model, mp.master.masters if mp.master else []) if step == 0 else None
        wrap = last_step(model) if last_step is not None and step == steps - 1 else contextlib.nullcontext()
        with meter or contextlib.nullcontext(), wrap:
            with mp.autocast():
                loss = workload.loss_fn(predictions(model(data.x_train[idx])), data.y_train[idx])
            mp.backward(loss)
        if meter is not None:
            saved = meter.bytes
        mp.step()
        mp.zero_grad()
        losses.append(loss.detach())
    return Lockstep(str(recipe), tuple(torch.stack(losses).float().tolist()), saved)


@dataclasses.dataclass(frozen=True)
class Band:
    """fp32 from two seeds: their losses, and the band (nats) a plan's tail must stay within."""

    losses_a: tuple[float, ...]
    losses_b: tuple[float, ...]
    spread: float               # |tail(a) - tail(b)|
    floor: float                # _BAND_FLOOR x fp32's loss drop over the run
    band: float                 # max(spread, floor) x the budget multiplier


def fp32_band(workload: Workload, *, steps: int, seed: int, device: torch.device, budget: float = 1.0) -> Band:
    """Train fp32 from ``seed`` and ``seed + 1``; WorkloadDiverges if either does not learn."""
    runs = [lockstep(workload, "fp32", steps=steps, seed=s, device=device) for s in (seed, seed + 1)]
    for run, s in zip(runs, (seed, seed + 1)):
        if not all(math.isfinite(v) for v in run.losses):
            raise WorkloadDiverges(f"{workload.name} diverges in fp32 (seed {s}: a non-finite loss within "
                                   f"{steps} steps); fix the workload (learning rate, init) before planning "
                                   "its precision")
        if not run.tail < run.losses[0]:
            raise WorkloadDiverges(f"{workload.name} does not learn in fp32 over {steps} steps (seed {s}: loss "
                                   f"{run.losses[0]:.4g} -> {run.tail:.4g}); plan over more --steps or fix "
                                   "the workload")
    spread = abs(runs[0].tail - runs[1].tail)
    floor = _BAND_FLOOR * (runs[0].losses[0] - runs[0].tail)
    return Band(runs[0].losses, runs[1].losses, spread, floor, max(spread, floor) * budget)


@contextlib.contextmanager
def capture_what_if(model: nn.Module, into: dict, weights: dict | None = None,
                    experts_into: dict | None = None) -> Iterator[None]:
    """The doctor's what-if for every linear of ``model`` over one forward and backward, stored in
    ``into`` by layer name; ``weights`` (if given) gets a copy of the model's state as the step began;
    ``experts_into`` (if given) each experts module's per-tensor fp8 evidence (``experts.py``)."""
    if weights is not None:
        weights.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    capture = WhatIfCapture(model)
    experts = ExpertsCapture(model)
    with capture.capturing(), experts.capturing():
        yield
    into.update({layer.name: layer for layer in capture.layers()})
    if experts_into is not None:
        experts_into.update(experts.evidence())


# The gradient signal-to-noise ratio below which a format's weight gradients stop pointing the way
# fp32's do ("FP4 All the Way": sqrt(3)); the MXFP8 issue's finding: nvfp4 crossed it as it left
# fp32's band, the fp8 formats stayed above it. The doctor's measure, one definition for both tools.
GRAD_SNR_THRESHOLD = SNR_FLOOR


def gradient_snr(workload: Workload, weights: dict, fmt: str, *, step: int, seed: int, steps: int,
                 device: torch.device, layers: Iterable[str],
                 projections: dict[str, tuple[str, ...]] | None = None) -> dict[str, float]:
    """End-to-end weight-gradient SNR of ``fmt`` per layer: ``|g| / |g_fmt - g|`` where ``g`` is fp32's
    gradient and ``g_fmt`` the gradient with every planned layer in ``fmt`` (the whole model run under
    it, so errors that propagate through the backward count), at the same ``weights`` and batch
    (``step`` of the lockstep order): the doctor's ``grad_snr.gradient_snr`` on the workload's model.
    An experts module's name (a key of ``projections``, its projections' names) stands for both
    projections, their gradients together.
    One forward and backward per recipe; nothing is trained."""
    data = workload.load_data().to(device)
    idx = batch_order(len(data.y_train), workload.batch_size, steps, seed)[step].to(device)
    x, y = data.x_train[idx], data.y_train[idx]
    names = list(layers)

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return workload.build_model()

    recipe = f"bf16,fp8={fmt}"
    fp8 = names + [p for n in names for p in (projections or {}).get(n, ())]
    snr = doctor_gradient_snr(build, weights, lambda model: workload.loss_fn(predictions(model(x)), y), [recipe],
                              layers=names, device=device, seed=seed, fp8_layers=fp8)
    return {n: snr[n][recipe].snr for n in names}

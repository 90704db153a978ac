"""fp32 copies of low-precision weights that the optimizer updates in their place.

An fp16 weight cannot absorb an update smaller than half its ulp: with |w| / |update| > 2048 the sum
rounds back to w and the update is lost (fp16 keeps 11 significant bits, so 1 + 2**-12 == 1). So the user's optimizer is pointed at fp32 copies:
the low-precision gradients are cast into the copies' ``.grad``, the optimizer steps there (its state is
fp32 too) and the result is rounded back into the model.

Two lifetimes, one mechanism:

- ``keep=True`` (fp16-pure, bf16-pure): the fp32 copy persists between steps: a master copy, +4 B/param.
- ``keep=False`` (bf16-sr): the copy lives only during the step, made from the bf16 weights and
  rounded back *stochastically*, so an update below half an ulp survives in expectation. The optimizer
  state stays fp32; no master copy is held.
- ``keep=False, rounding=KAHAN`` (bf16-kahan): the transient copy is the bf16 weight joined with a
  16-bit compensation kept per weight, and split back into the two after the step: the fp32 value
  exactly, at 2 + 2 B/param (``update/kahan.py``).

The step walks the optimizer's tensors in chunks of fp32 transients (``chunks.py``), laid end to end in
flat buffers, a small model's kept between steps (``transients.py``), and rounds each chunk back into the
model (``writeback.py``). ``MasterWeights`` is those three parts together with what they share: the
copies, made here from the fp32 weights and swapped into the optimizer, the weights the user changed
taken as the truth (``adopt_model_changes``), and the state a checkpoint saves.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .chunks import DEFAULT_CHUNK_BYTES, ChunkedStep
from .kahan import KahanCompensation
from ..recipe import Rounding
from .stochastic_rounding import RoundingNoise
from .transients import Fp32Transients, kept_gradient_bytes
from .writeback import Writeback

if TYPE_CHECKING:
    from .transients import _Layout

# DEFAULT_CHUNK_BYTES (chunks.py) and kept_gradient_bytes (transients.py) are named here as before.
__all__ = ["MasterWeights", "DEFAULT_CHUNK_BYTES", "kept_gradient_bytes"]

_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


class MasterWeights(ChunkedStep, Writeback, Fp32Transients):
    """fp32 stand-ins for low-precision parameters inside the user's optimizer.

    On construction the optimizer's references to ``params`` (still fp32 at that moment) are replaced
    by fp32 clones, and existing optimizer state moves with them. Call ``pull_grads`` before the
    optimizer step and ``push_weights`` after it (or ``step``, which does both chunk by chunk).
    """

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, *,
                 keep: bool, rounding: Rounding = Rounding.NEAREST, seed: int = 0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
            raise ValueError(f"chunk_bytes must be a positive int (bytes of fp32 transients per optimizer "
                             f"call, e.g. {DEFAULT_CHUNK_BYTES}), got {chunk_bytes!r}")
        if keep and rounding is not Rounding.NEAREST:
            raise ValueError(f"rounding={rounding.value} is for weights without a master copy (keep=False, "
                             "recipe bf16-sr or bf16-kahan); with a master copy the weights are its nearest "
                             "rounding")
        self.model_params = list(params)
        devices = {p.device for p in self.model_params}
        if len(devices) > 1:
            raise ValueError(f"the low-precision parameters are on {len(devices)} devices "
                             f"({', '.join(sorted(map(str, devices)))}): mixprec steps fp32 copies of "
                             "one device's weights; move the model to one device")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.keep = keep
        self.rounding = rounding
        self.chunk_bytes = chunk_bytes
        self._workspace: torch.Tensor | None = None     # see transients.py's docstring
        # A small one-chunk step's fp32 gradient views into the kept workspace: (key, views), laid out once.
        self._small_views: tuple[list, list[torch.Tensor]] | None = None
        # keep=False, a small model's one-chunk step: the [weights | gradients] buffer and its views,
        # laid out once (_transient_layout); the views of its rounded bf16 half shaped like the
        # weights, and bf16-sr's noise xors into its scratch (the tables they read, the xors).
        self._layout: _Layout | None = None
        self._rounded_views: list[torch.Tensor] | None = None
        self._noise_plan: tuple[Any, list] | None = None
        self._step_plan: list | None = None              # begin_step's chunks (None: one chunk)
        self._planned = False                            # begin_step planned this step
        self._grad_sources: tuple[list, list] | None = None   # grads(): (groups' key, tensors to read)
        # What pull_grads laid out for push_weights: (positions, flat fp32 weights), keep=False only.
        self._pulled: tuple[list[int], torch.Tensor] | None = None
        # Clone before the model is cast: the master starts as the exact fp32 initial weights.
        self.masters = [nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
                        for p in self.model_params]
        by_id = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._index = {id(m): i for i, m in enumerate(self.masters)}   # fp32 copy -> its position
        for group in optimizer.param_groups:
            group["params"] = [by_id.get(id(p), p) for p in group["params"]]
        for p in self.model_params:
            if p in optimizer.state:
                optimizer.state[by_id[id(p)]] = optimizer.state.pop(p)
        self._numel = [p.numel() for p in self.model_params]
        self._numel_total = sum(self._numel)
        # The positions in the optimizer's order, as a one-chunk step lays them out; and where each
        # copy starts in that layout (the rounding noise's positions, the same in every chunking).
        order = [self._index[id(t)] for g in optimizer.param_groups for t in g["params"]
                 if id(t) in self._index]
        self._order = order + sorted(set(range(len(self.masters))) - set(order))
        self._start = [0] * len(self.masters)
        total = 0
        for i in self._order:
            self._start[i], total = total, total + self._numel[i]
        # A transient copy between steps: one empty tensor, shared (the optimizer keys state by the
        # Parameter object, which stays).
        self._empty = torch.empty(0, dtype=torch.float32, device=self.device)
        # Stochastic rounding's noise source; named as the torch.Generator it replaced (checkpoints).
        self.generator: RoundingNoise | None = None
        if rounding is Rounding.STOCHASTIC:
            self.generator = RoundingNoise(seed, total, self.device)
        # bf16-kahan: the compensations, from the fp32 weights (which it sets to their bf16 rounding).
        self.kahan = KahanCompensation(self.model_params, self._start, total) if rounding is Rounding.KAHAN else None
        if not keep:
            self._release(range(len(self.masters)))
        # Each weight's version counter as the engine last left it (the engine writes through .data,
        # which moves none): a user's in-place write moves it (adopt_model_changes).
        self._versions = [p._version for p in self.model_params]
        self._noted = False

    def adopt_model_changes(self) -> None:
        """Take a weight the user changed since the engine last wrote it as the truth.

        ``model.load_state_dict``, an in-place edit under ``no_grad``, a re-initialised layer, EMA
        weights swapped in: each moves the parameter's version counter. Then, under ``keep=True``, the
        master takes the new value wherever the weight is no longer the master's rounding (where it
        still is, e.g. EMA weights swapped back out, the master keeps its fp32 bits), and under
        bf16-kahan the weight's compensations are zeroed (its fp32 value is the new weight). A
        ``UserWarning`` says so the first time. Cost: one int compare per weight (host metadata, no
        sync); a pass over the data only for a changed weight. Writes through ``param.data`` move no
        counter and go unseen: write through the parameter (docs/recipes.md).
        """
        versions = [p._version for p in self.model_params]
        if versions == self._versions:
            return
        changed = [i for i, (a, b) in enumerate(zip(versions, self._versions)) if a != b]
        moved = not self.keep     # kahan cannot tell an unchanged value from a new one: always said
        with torch.no_grad():
            for i in changed:
                p = self.model_params[i]
                if self.keep:
                    m = self.masters[i].data
                    # The user's value wherever it is not the master's rounding: bitwise (NaN != NaN:
                    # a NaN weight is taken too), so -0.0 over a master that rounds to +0.0 counts.
                    differs = p.view(_BITS[p.dtype]) != m.to(p.dtype).view(_BITS[p.dtype])
                    m.copy_(torch.where(differs, p.float(), m))
                    # Whether to say so: a write of the same values (a broadcast) changes nothing.
                    moved = moved or (not self._noted and bool(differs.any()))   # a sync, on a change only
                elif self.kahan is not None:
                    self.kahan.reset_(i)
        self._versions = versions
        if not self._noted and moved and (self.keep or self.kahan is not None):
            self._noted = True
            what = ("its fp32 master took the new values" if self.keep
                    else "its Kahan compensations were reset (the fp32 value is the new bf16 weight)")
            warnings.warn(f"{len(changed)} low-precision parameter(s) changed since the engine last wrote "
                          f"them (model.load_state_dict, an in-place edit, a re-initialised layer): {what}, "
                          "so the model's values are the truth. To load fp32 weights at fp32 precision "
                          "use mp.load_model_state_dict(state_dict). Said once per engine.",
                          UserWarning, stacklevel=3)

    def mark_synced(self) -> None:
        """The weights and what the engine keeps beside them agree now (a checkpoint loaded both)."""
        self._versions = [p._version for p in self.model_params]

    @torch.no_grad()
    def load_fp32_(self, i: int, value: torch.Tensor) -> None:
        """Set weight ``i`` from fp32 ``value`` at fp32 precision: the master (or Kahan's exact pair)
        holds ``value`` and the 16-bit weight its rounding, as if the optimizer had stepped there."""
        p = self.model_params[i]
        flat = value.detach().to(device=p.device, dtype=torch.float32).reshape(-1).clone()
        if self.keep:
            self.masters[i].data.copy_(flat.view(p.shape))
            p.data.copy_(flat.view(p.shape))                 # round to nearest even, as a step does
        elif self.kahan is not None:
            w = self.kahan.split_(flat, [[0, self.kahan.starts[i], p.numel()]])
            p.data.copy_(w.view(p.shape))
        else:                                                # bf16-sr: the weight is all there is
            p.data.copy_(flat.view(p.shape))
        self._versions[i] = p._version

    def numel_of(self, t: torch.Tensor) -> int:
        """Elements of ``t``; for an fp32 copy, of the weight it stands for (transient ones are empty)."""
        i = self._index.get(id(t))
        return t.numel() if i is None else self._numel[i]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._planned = False
        for m in self.masters:
            if set_to_none:
                m.grad = None
            elif m.grad is not None:
                m.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        self.adopt_model_changes()
        state = {"masters": [m.detach().clone() for m in self.masters] if self.keep else None,
                 "generator": self.generator.get_state() if self.generator is not None else None}
        if self.kahan is not None:
            state["compensation"] = self.kahan.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; everything is checked before anything is written."""
        masters = state.get("masters")
        if self.keep:
            if masters is None or len(masters) != len(self.masters):
                raise ValueError(f"master state holds {0 if masters is None else len(masters)} tensors, "
                                 f"this model has {len(self.masters)} low-precision parameters: was it "
                                 "saved from a different model or recipe?")
            for m, saved in zip(self.masters, masters):
                if m.shape != saved.shape:
                    raise ValueError(f"master weight shape {tuple(saved.shape)} in the state does not "
                                     f"match the model's {tuple(m.shape)}")
        noise = state.get("generator")
        if self.generator is not None and noise is not None:
            self.generator.check_state(noise)
        if self.kahan is not None:
            self.kahan.check_state(state.get("compensation"))
        if self.keep:
            for m, saved in zip(self.masters, masters):
                m.data.copy_(saved)
        if self.generator is not None and noise is not None:
            self.generator.set_state(noise)
        if self.kahan is not None:
            self.kahan.load_state_dict(state["compensation"])
        self.mark_synced()     # a checkpoint's model weights and these belong together

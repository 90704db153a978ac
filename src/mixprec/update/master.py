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

No fp32 gradient is held between steps (the usual 16 B/param with Adam: 2 weights + 2 gradients + 4
master + 8 moments; a small model's few MiB aside, below). ``step`` walks the optimizer's tensors in
chunks of at most ``chunk_bytes`` of fp32
transients (the chunk's gradients, and for ``keep=False`` its weights): it casts the chunk's 16-bit
gradients into fp32, lets the optimizer step only that chunk, rounds the result into the model and
frees the transients before the next chunk. So the step's extra memory is bounded by ``chunk_bytes``
(64 MiB by default; a single tensor larger than that is its own chunk), and a model whose fp32 copies
fit in one chunk steps in one ``optimizer.step()`` call exactly as a plain optimizer would.

A chunk's fp32 transients are laid end to end in one flat buffer, and the per-tensor copies the
optimizer sees are views of it (made in one call, ``_views``). So every pass over the data is one op
per chunk, never one per tensor: one ``torch._foreach_copy_`` casts the chunk's 16-bit weights in, one
its gradients, a few elementwise ops over the flat buffer round it (``stochastic_round_bf16_``) and
one ``torch._foreach_copy_`` casts or copies the result into the model. What stays per tensor is
Python bookkeeping that reads no data (pointing each copy at its view, and back at an empty tensor).
With ``keep=False`` one buffer of the largest chunk's size serves every chunk of a step and is freed
when the step ends (a small model's is kept, below).

On CPU the chunks of a step in several chunks, and a single chunk of at least ``_WORKSPACE_MIN`` (32
MiB) of fp32 gradients, are cast into one flat fp32 workspace that is kept between steps (the largest
chunk: at most ``chunk_bytes``, or one larger tensor; ``workspace_bytes``): allocating each chunk's
casts afresh was measured 2-3x slower there (benchmarks/RESULTS.md, page faults on fresh memory; with
4 MiB chunks of 16 MiB tensors 7 ms of a 24 ms step). CUDA's caching allocator reuses the freed block
by itself, so on CUDA large chunks keep nothing.

A small model, whose step's fp32 transients fit ``_SMALL_KEPT`` (4 MiB) in one chunk, keeps them and
their views between steps, on every device: with ``keep=True`` the gradient workspace (4 B/param; while
every gradient is dense and contiguous, ``_kept_views``), with ``keep=False`` the [weights | gradients]
buffer (8 B/param, ``_transient_layout``), with its bit views (``bit_views.Fp32Bits``) and bf16-sr's
noise xors into its scratch. Laying them out again cost a third of such a step's host work (15-30
aten ops for 6 tensors; the bit views and xors 15 more for bf16-sr, 12 for bf16-kahan), which is all a
small model's GPU step waits for. They are held
through the forward and backward too; ``memory_report`` counts them (``kept_gradient_bytes``) and
``workspace_bytes`` says them. Other models keep nothing between steps.

The engine reads the global norm before the first chunk steps, from the model's 16-bit gradients
(``grad_norm.GradNorm``: no fp32 copies), whatever the chunking: the same tensors read the same way, so
a chunked step's norm, and with it the clip and the skip, is bitwise the one-call step's.

The stochastic rounding's noise (``stochastic_rounding.RoundingNoise``) is a function of the seed,
the number of steps taken and the element's position: not of the chunking (a chunked step rounds bitwise as the one-call
step), not of the device (integer arithmetic), and not of skipped steps (the count of steps taken
advances on the device by ``1 - found_inf``, no host sync), so a run that skipped a bad step rounds
the rest of its steps exactly as one that never saw it. That holds in ``step``, which reads the flag
the engine hands a fused optimizer; ``push_weights`` (the copies filled whole, for step observers or
a compiled step) counts every call as a step taken unless it is handed ``found_inf`` too.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from .bit_views import Fp32Bits
from .kahan import KahanCompensation
from ..recipe import Rounding
from .stochastic_rounding import RoundingNoise, run_fill_plan, stochastic_round_bf16_

__all__ = ["MasterWeights", "DEFAULT_CHUNK_BYTES", "kept_gradient_bytes"]

# The fp32 transients of one optimizer call: small next to any model worth chunking (gpt2: 8 chunks),
# large enough that a step makes few calls (a 7B model: ~420, each a multi-tensor kernel on CUDA).
DEFAULT_CHUNK_BYTES = 64 * 2**20
_WORKSPACE_MIN = 32 * 2**20      # CPU: fp32 gradient chunks this large go into a kept workspace
# Any device: a one-chunk step's fp32 transients up to this size stay between steps,
# laid out once (MasterWeights._kept_views, _transient_layout).
_SMALL_KEPT = 4 * 2**20
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def kept_gradient_bytes(elements: int, keep: bool) -> int:
    """Bytes of fp32 transients ``MasterWeights`` keeps between steps for ``elements`` low-precision
    weights: a small model's (at most ``_SMALL_KEPT`` bytes) fp32 gradients with a master copy
    (``_kept_views``), or fp32 weights and gradients without one (``_transient_layout``); else none."""
    size = (4 if keep else 8) * elements
    return size if size <= _SMALL_KEPT else 0


class _Layout(NamedTuple):
    """keep=False, a small model: the step's fp32 transients, laid out once (``_transient_layout``)."""

    buffer: torch.Tensor               # [weights | gradients], fp32, in the optimizer's order
    weights_flat: torch.Tensor         # the weight half
    weights: list[torch.Tensor]        # views of it shaped like the weights
    grad_slots: list[torch.Tensor]     # views of the gradient half shaped like the weights
    scratch: torch.Tensor              # the gradient half as int32: the rounding's noise after the step
    bits: Fp32Bits                     # the weight half's bit views (the rounding and Kahan's split)


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped like ``like``, laid end to end in 1-D ``flat`` (views of it). One C++ call,
    torch's own unflatten as DDP uses it, rather than a view per tensor made from Python."""
    return list(torch._C._nn.unflatten_dense_tensors(flat, like)) if like else []   # no wrapper call


def _without_grad(fn: Callable) -> Callable:
    """``fn`` with autograd off, as ``@torch.no_grad()`` does, in three C calls where the decorator
    makes about ten Python ones at every call (it runs in every pure step, once or twice per chunk)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(prev)
    return wrapper


def _found_inf(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The ``found_inf`` tensor torch's amp protocol hands a fused optimizer for this step, if any.

    ``torch.amp.GradScaler``, and the engine's fused path alike, set it on the optimizer whose kernel
    reads it (that one, or the one a pass-through wrapper holds as ``.optimizer``) for the duration of
    ``step()``; the kernel skips the update where it is nonzero. None where the host decided.
    """
    for opt in (optimizer, getattr(optimizer, "optimizer", None)):
        flag = getattr(opt, "found_inf", None)
        if isinstance(flag, torch.Tensor):
            return flag
    return None


class MasterWeights:
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
        self._workspace: torch.Tensor | None = None     # see the module docstring
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

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Plan the step's chunks (``step`` uses the plan). Casts nothing; no sync."""
        self.adopt_model_changes()
        self._step_plan = self._plan(optimizer)
        self._planned = True

    def grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The gradients for every tensor ``optimizer`` steps, in its order: the model's 16-bit gradient
        for an fp32 copy (whose own is cast chunk by chunk inside ``step``), the tensor's own gradient
        otherwise. No copy, no sync."""
        # Whose .grad to read, per tensor the optimizer steps: worked out again only when its groups'
        # lists are other lists or other lengths (add_param_group, a chunked step's narrowing).
        key = [(id(group["params"]), len(group["params"])) for group in optimizer.param_groups]
        if self._grad_sources is None or self._grad_sources[0] != key:
            sources = []
            for group in optimizer.param_groups:
                for t in group["params"]:
                    i = self._index.get(id(t))
                    sources.append(t if i is None else self.model_params[i])
            self._grad_sources = (key, sources)
        return [s.grad for s in self._grad_sources[1] if s.grad is not None]

    def skip_step(self) -> None:
        """A skipped step: drop the plan and any fp32 gradient; the weights stay as they are, and so
        does the rounding noise (no step was taken)."""
        self._planned = False
        self._pulled = None
        for m in self.masters:
            m.grad = None
        if not self.keep:
            self._release(range(len(self.masters)))

    def numel_of(self, t: torch.Tensor) -> int:
        """Elements of ``t``; for an fp32 copy, of the weight it stands for (transient ones are empty)."""
        i = self._index.get(id(t))
        return t.numel() if i is None else self._numel[i]

    def pull_grads(self, which: list[int] | None = None, *, chunked: bool = False) -> None:
        """Cast the model's low-precision gradients into the fp32 copies (and, transient, the weights).

        Casting fp16/bf16 to fp32 is exact: the copies hold what backward made. ``which`` picks copies
        by position (default: all, in the optimizer's order); ``chunked``: they are one chunk of several
        (CPU: the workspace).
        """
        buffer = None
        if which is None:
            self.adopt_model_changes()
            # All copies, transient: a small model's kept buffer (the same addresses at every step,
            # which a CUDA graph of the compiled step replays on).
            layout = None if self.keep or chunked else self._transient_layout()
            buffer = None if layout is None else layout.buffer
        self._pull(self._order if which is None else list(which), chunked, buffer)

    @_without_grad
    def _pull(self, which: list[int], chunked: bool, buffer: torch.Tensor | None) -> None:
        """``pull_grads``; transient weights and gradients go into ``buffer`` (default: a fresh one)."""
        if not which:
            return
        params = [self.model_params[i] for i in which]
        masters = [self.masters[i] for i in which]
        dense = [p for p in params if p.grad is not None and p.grad.layout == torch.strided]
        if not self.keep:
            # [weights | gradients], each in the chunk's order. The gradient half has a slot for every
            # copy (a gradient-less one leaves its slot unused): it is the rounding's scratch later.
            layout = self._layout
            views = None
            if layout is not None and buffer is layout.buffer and which is self._order:
                # Laid out once (_transient_layout).
                weights_flat, weights, slot_views, views = (layout.weights_flat, layout.weights,
                                                            layout.grad_slots, layout.bits)
            else:
                n = sum([self._numel[i] for i in which])
                flat = buffer[:2 * n] if buffer is not None else torch.empty(2 * n, dtype=torch.float32,
                                                                              device=self.device)
                weights_flat, weights = flat[:n], _views(flat[:n], params)
                slot_views = _views(flat[n:], params)
            torch._foreach_copy_(weights, params)    # bf16 -> fp32: exact
            if self.kahan is not None:               # + the compensations: the fp32 values, exactly
                self.kahan.join_(weights_flat, which, self._runs(which), views)
            for m, w in zip(masters, weights):
                m.data = w
            if len(dense) == len(params):
                dests = slot_views
            else:
                slots = dict(zip(map(id, params), slot_views))
                dests = [slots[id(p)] for p in dense]
            self._pulled = (which, weights_flat)
        else:
            dests = self._kept_views(which, params, dense) if which is self._order else None
            workspace = None if dests is not None else self._workspace_for(which, chunked)
            if dests is not None:
                pass
            elif workspace is not None:
                n = (sum([self._numel[i] for i in which]) if len(dense) == len(params)   # no tensor read
                     else sum([p.numel() for p in dense]))
                dests = _views(workspace[:n], dense)
            else:   # not the CPU: a gradient already there is refilled in place (its address stays)
                by_param = {id(p): m for p, m in zip(params, masters)}
                dests = [by_param[id(p)].grad for p in dense]
                dests = [d if d is not None and d.shape == p.shape else None for p, d in zip(dense, dests)]
                # New ones: views of one block where the 16-bit gradient is contiguous; otherwise its
                # own tensor in the gradient's layout (channels_last), as the optimizer's kernels want.
                flat_ok = [p for p, d in zip(dense, dests) if d is None and p.grad.is_contiguous()]
                made = iter(_views(torch.empty(sum(p.numel() for p in flat_ok), dtype=torch.float32,
                                               device=self.device), flat_ok))
                dests = [d if d is not None else next(made) if p.grad.is_contiguous()
                         else torch.empty_like(p.grad, dtype=torch.float32) for p, d in zip(dense, dests)]
        if dense:
            torch._foreach_copy_(dests, [p.grad for p in dense])             # 16-bit -> fp32: exact
        if len(dense) == len(params):    # every gradient dense (the usual case): dests align with masters
            for m, d in zip(masters, dests):
                if m.grad is not d:
                    m.grad = d
            return
        dest_of = dict(zip(map(id, dense), dests))
        for p, m in zip(params, masters):
            if p.grad is None:
                m.grad = None
            elif id(p) in dest_of:
                if m.grad is not dest_of[id(p)]:
                    m.grad = dest_of[id(p)]
            else:
                m.grad = p.grad.float()      # a sparse gradient: cast on its own, as it is

    @property
    def workspace_bytes(self) -> int:
        """Bytes of fp32 transients kept between steps: the gradient workspace (a small model's with a
        master copy, or the CPU's large chunks) or a small model's [weights | gradients] buffer without."""
        kept = [self._workspace, None if self._layout is None else self._layout.buffer]
        return sum([t.untyped_storage().nbytes() for t in kept if t is not None])

    def _kept_views(self, which: list[int], params: list[nn.Parameter],
                    dense: list[nn.Parameter]) -> list[torch.Tensor] | None:
        """A small model's one-chunk step (``which`` is every copy): views of a workspace kept between
        steps, shaped like the gradients, made once and reused while every gradient is dense and
        contiguous with the same shapes and dtypes; None otherwise (or above ``_SMALL_KEPT`` bytes).

        Laying the fp32 gradients out afresh costs a workspace and a view per tensor at every step
        (about 15 aten ops for 6 tensors, a third of the pure step's host work on a small model, which
        is all a small model's GPU step waits for); keeping them costs at most 4 MiB, a block the CUDA
        caching allocator would hold anyway."""
        if len(dense) != len(params) or 4 * self._numel_total > _SMALL_KEPT:   # which: every copy
            return None
        key = [(p.grad.shape, p.grad.dtype, p.grad.is_contiguous()) for p in dense]
        if self._small_views is not None and self._small_views[0] == key:
            return self._small_views[1]
        need = sum([self._numel[i] for i in which])
        if not all([c for _, _, c in key]):
            self._small_views = None
            return None
        self._workspace = torch.empty(need, dtype=torch.float32, device=self.device)
        self._small_views = (key, _views(self._workspace, dense))
        return self._small_views[1]

    def _workspace_for(self, which, chunked: bool) -> torch.Tensor | None:
        if not self.keep or not self.masters or self.device.type != "cpu":
            return None
        need = sum([self._numel[i] for i in which if self.model_params[i].grad is not None
                    and self.model_params[i].grad.layout == torch.strided])   # a list: no generator resumes
        if 4 * need < _WORKSPACE_MIN and not chunked:
            # Kept nothing between steps, but still one flat block for the chunk's casts: glibc reuses
            # one freed block, where many freed together were handed back to the kernel and faulted in
            # again each step (measured: one-chunk steps 1.5-2x slower at random).
            return torch.empty(need, dtype=torch.float32, device=self.device)
        if self._workspace is None or self._workspace.numel() < need:   # kept: at most the largest chunk
            self._workspace = torch.empty(need, dtype=torch.float32, device=self.device)
        return self._workspace

    def step(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any],
             inv_divisor: torch.Tensor | None = None) -> None:
        """One optimizer step in chunks: per chunk cast the gradients into fp32 (times ``inv_divisor``,
        the unscale and clip factor, when given), call ``step_fn`` with the optimizer's groups narrowed
        to the chunk, round the result into the model and free the fp32 transients.

        ``step_fn`` steps what ``optimizer.param_groups`` holds at the time of the call (torch's
        ``optimizer.step``, or the engine's own AdamW). Its step pre/post hooks run once per chunk.
        Multiplying after the exact cast is what the unchunked step did: the same bits. No sync.
        """
        plan = self._step_plan if self._planned else self._plan(optimizer)
        self._planned = False
        chunks = [self._order] if plan is None else [self._positions(chunk) for chunk in plan]
        # Read before the optimizer runs: the flag its kernel will test (None: the host decided).
        found_inf = _found_inf(optimizer)
        tables = self.generator.tables() if self.generator is not None else None
        buffer = None
        layout = self._transient_layout() if not self.keep and plan is None else None
        if layout is not None:      # a small model: the buffer and its views kept from the last step
            buffer = layout.buffer
        elif not self.keep:   # one [weights | gradients] buffer for every chunk: the largest one's size
            largest = max([sum([self._numel[i] for i in which]) for which in chunks], default=0)
            buffer = torch.empty(2 * largest, dtype=torch.float32, device=self.device)
        if plan is None:            # everything fits one chunk: the optimizer's groups stay as built
            self._step_chunk(optimizer, chunks[0], step_fn, inv_divisor, False, buffer, tables)
        else:
            groups = optimizer.param_groups
            saved = [g["params"] for g in groups]
            try:
                for chunk, which in zip(plan, chunks):
                    for group, members in zip(groups, chunk):
                        group["params"] = members
                    self._step_chunk(optimizer, which, step_fn, inv_divisor, True, buffer, tables)
            finally:
                for group, members in zip(groups, saved):
                    group["params"] = members
        if self.generator is not None:
            self.generator.advance(found_inf)

    def _positions(self, chunk: list[list[torch.Tensor]]) -> list[int]:
        """The positions of a chunk's fp32 copies (its fp32 tensors of the model's own have none)."""
        return [self._index[id(t)] for members in chunk for t in members if id(t) in self._index]

    def _step_chunk(self, optimizer, which: list[int], step_fn, inv_divisor, chunked: bool,
                    buffer: torch.Tensor | None, tables) -> None:
        self._pull(which, chunked, buffer)
        if inv_divisor is not None:
            # fp32 copies and fp32 model gradients alike: the optimizer sees grad * clip / S.
            grads = [t.grad for g in optimizer.param_groups for t in g["params"] if t.grad is not None]
            if grads:
                torch._foreach_mul_(grads, inv_divisor)
        step_fn()
        for i in which:     # the fp32 gradients go (and, transient, their slots become scratch)
            self.masters[i].grad = None
        scratch = None
        layout = self._layout
        if layout is not None and buffer is layout.buffer and which is self._order:
            scratch = layout.scratch
        elif buffer is not None:
            n = sum([self._numel[i] for i in which])
            scratch = buffer[n:2 * n].view(torch.int32)
        self._round_into_model(which, tables, scratch)

    def _plan(self, optimizer) -> list[list[list[torch.Tensor]]] | None:
        """The optimizer's tensors cut into chunks of at most ``chunk_bytes`` of fp32 transients, each
        chunk one list per param group; None when one chunk holds them all."""
        per_element = 4 if self.keep else 8      # an fp32 gradient, plus an fp32 weight when transient
        if per_element * self._numel_total <= self.chunk_bytes:     # the usual case: read no tensor
            return None
        sizes = {id(m): per_element * n for m, n in zip(self.masters, self._numel)}
        chunks, size = [], 0
        current: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for gi, group in enumerate(optimizer.param_groups):
            for t in group["params"]:
                b = sizes.get(id(t), 0)       # fp32 tensors the model holds cost no transient
                if size and size + b > self.chunk_bytes:
                    chunks.append(current)
                    current, size = [[] for _ in optimizer.param_groups], 0
                current[gi].append(t)
                size += b
        chunks.append(current)
        return chunks

    @torch.no_grad()
    def push_weights(self, which: list[int] | None = None, *, found_inf: torch.Tensor | None = None) -> None:
        """Round the fp32 copies into the model's weights (nearest, or stochastic for bf16-sr).

        Rounding an unchanged copy gives back the model's weight bit for bit, whatever the noise, so
        this is safe to run after a step the optimizer skipped on the device. ``which`` picks copies
        by position (default: all); one call rounds one step. ``found_inf``: the flag the optimizer's
        kernel skipped on, if it did so on the device; then a skipped step does not count as taken
        for the rounding noise (without it every call counts).
        """
        which = self._order if which is None else list(which)
        if which:
            tables = self.generator.tables() if self.generator is not None else None
            # Fresh scratch: the copies' gradients stay intact for whoever still holds them.
            scratch = torch.empty(sum([self._numel[i] for i in which]), dtype=torch.int32,
                                  device=self.device) if self.generator is not None else None
            self._round_into_model(which, tables, scratch)
        if self.generator is not None:
            self.generator.advance(found_inf)

    @_without_grad
    def _round_into_model(self, which: list[int], tables, scratch: torch.Tensor | None) -> None:
        """Round copies ``which`` into the model: one pass per chunk. Transient ones are released."""
        if not which:
            return
        targets = [self.model_params[i].data for i in which]
        if self.generator is None and self.kahan is None:
            torch._foreach_copy_(targets, [self.masters[i] for i in which])   # round to nearest even
        else:
            flat = self._pulled_weights(which)
            layout = self._layout
            # A small model's kept buffer, all of it: its bit views, the noise's xors and the rounded
            # weights' views are made once, not at every step.
            kept = layout is not None and flat is layout.weights_flat and which is self._order
            if self.kahan is not None:     # nearest (ties away), the rest kept as compensations
                rounded = self.kahan.split_(flat, self._runs(which), layout.bits if kept else None)
            else:
                kept = kept and scratch is layout.scratch
                run_fill_plan(self._noise_xors(which, tables, scratch, kept))
                rounded = stochastic_round_bf16_(flat, scratch, layout.bits if kept else None)
            torch._foreach_copy_(targets, self._rounded_as(rounded, targets, kept))   # bf16 high halves
        if not self.keep:
            self._release(which)

    def _noise_xors(self, which: list[int], tables, scratch: torch.Tensor, kept: bool) -> list:
        """bf16-sr's noise for copies ``which`` into ``scratch`` as xors (``RoundingNoise.fill_plan``);
        for the kept layout (``kept``) laid out once per ``tables`` (eager steps: always the same)."""
        plan = self._noise_plan
        if kept and plan is not None and plan[0] is tables:
            return plan[1]
        xors = [x for offset, start, length in self._runs(which)
                for x in self.generator.fill_plan(scratch[offset:offset + length], start, tables)]
        if kept:
            self._noise_plan = (tables, xors)
        return xors

    def _transient_layout(self) -> _Layout | None:
        """keep=False, a small model (fp32 weights and gradients of at most ``_SMALL_KEPT`` bytes):
        the ``_Layout``, made at the first step and kept; None for other models.

        Laying these out afresh cost about 30 aten ops per step for 6 tensors (a slice and a view per
        tensor per half), more than the rounding itself on a small model; keeping them costs at most
        4 MiB (8 B/param), a block the CUDA caching allocator would hold anyway."""
        if self._layout is None:
            n = self._numel_total
            if 8 * n > _SMALL_KEPT:
                return None
            params = [self.model_params[i] for i in self._order]
            buffer = torch.empty(2 * n, dtype=torch.float32, device=self.device)
            weights = buffer[:n]
            self._layout = _Layout(buffer, weights, _views(weights, params), _views(buffer[n:], params),
                                   buffer[n:].view(torch.int32), Fp32Bits(weights))
        return self._layout

    def _rounded_as(self, rounded: torch.Tensor, targets: list[torch.Tensor], kept: bool) -> list[torch.Tensor]:
        """``rounded`` (a strided bf16 view) as tensors shaped like ``targets``: made once for the kept
        layout (``kept``: ``rounded`` is its weight half's high halves, the same view at every step),
        afresh otherwise."""
        if not kept:
            return _views(rounded, targets)
        if self._rounded_views is None:
            self._rounded_views = _views(rounded, targets)
        return self._rounded_views

    def _pulled_weights(self, which: list[int]) -> torch.Tensor:
        """The flat fp32 buffer whose views ``which``'s transient copies are (``_pull`` laid it out)."""
        if self._pulled is None or self._pulled[0] != which:
            raise RuntimeError("push_weights: these fp32 copies were not filled by pull_grads for this "
                               "step; call pull_grads(which) first, with the same positions")
        return self._pulled[1]

    def _runs(self, which: list[int]) -> list[list[int]]:
        """``[offset in the chunk, start in the step's layout, length]`` per stretch of ``which`` that
        lies end to end in the optimizer's order: one, unless its groups were reordered since."""
        runs: list[list[int]] = []
        offset = 0
        for i in which:
            start, n = self._start[i], self._numel[i]
            if runs and runs[-1][1] + runs[-1][2] == start:
                runs[-1][2] += n
            else:
                runs.append([offset, start, n])
            offset += n
        return runs

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._planned = False
        for m in self.masters:
            if set_to_none:
                m.grad = None
            elif m.grad is not None:
                m.grad.zero_()

    def _release(self, which) -> None:
        # A transient copy gives its memory back between steps: pointed at one shared empty tensor.
        for i in which:
            m = self.masters[i]
            m.data = self._empty
            m.grad = None
        self._pulled = None

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

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

No fp32 gradient is held between steps (the usual 16 B/param with Adam: 2 weights + 2 gradients + 4
master + 8 moments). ``step`` walks the optimizer's tensors in chunks of at most ``chunk_bytes`` of fp32
transients (the chunk's gradients, and for ``keep=False`` its weights): it casts the chunk's 16-bit
gradients into fp32, lets the optimizer step only that chunk, rounds the result into the model and
frees the transients before the next chunk. So the step's extra memory is bounded by ``chunk_bytes``
(64 MiB by default; a single tensor larger than that is its own chunk), and a model whose fp32 copies
fit in one chunk steps in one ``optimizer.step()`` call exactly as a plain optimizer would.

On CPU the chunks of a step in several chunks, and a single chunk of at least ``_WORKSPACE_MIN`` (32
MiB) of fp32 gradients, are cast into one flat fp32 workspace that is kept between steps (the largest
chunk: at most ``chunk_bytes``, or one larger tensor; ``workspace_bytes``): allocating each chunk's
casts afresh was measured 2-3x slower there (benchmarks/RESULTS.md, page faults on fresh memory; with
4 MiB chunks of 16 MiB tensors 7 ms of a 24 ms step). A model in one small chunk keeps nothing (its
casts share one fresh block per step).
CUDA's caching allocator reuses the freed block by itself, so on CUDA nothing is kept.

The engine reads the global norm before the first chunk steps, from the model's 16-bit gradients
(``grad_norm.GradNorm``: no fp32 copies), whatever the chunking: the same tensors read the same way, so
a chunked step's norm, and with it the clip and the skip, is bitwise the one-call step's.

    >>> w = torch.full((100_000,), 1.0)
    >>> stochastic_round_bf16(w + 2**-10, torch.Generator().manual_seed(0)).float().mean().item()
    1.0009...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .recipe import Rounding

__all__ = ["MasterWeights", "stochastic_round_bf16", "DEFAULT_CHUNK_BYTES"]

# The fp32 transients of one optimizer call: small next to any model worth chunking (gpt2: 8 chunks),
# large enough that a step makes few calls (a 7B model: ~420, each a multi-tensor kernel on CUDA).
DEFAULT_CHUNK_BYTES = 64 * 2**20
_WORKSPACE_MIN = 32 * 2**20      # CPU: fp32 gradient chunks this large go into a kept workspace


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down with probabilities that make the result unbiased.

    bf16 is fp32 with the low 16 mantissa bits dropped. Adding a uniform integer in [0, 2**16) to the
    bit pattern and then truncating those bits carries into bit 16 with probability equal to the
    dropped fraction of an ulp, for either sign (the low bits are magnitude bits). NaN stays NaN.
    """
    assert x.dtype == torch.float32, "stochastic rounding reads the fp32 bit pattern"
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # -65536 == 0xFFFF0000 as int32: clears the 16 bits bf16 does not hold, so .to(bf16) below is exact.
    rounded = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


class MasterWeights:
    """fp32 stand-ins for low-precision parameters inside the user's optimizer.

    On construction the optimizer's references to ``params`` (still fp32 at that moment) are replaced
    by fp32 clones, and existing optimizer state moves with them. Call ``pull_grads`` before the
    optimizer step and ``push_weights`` after it.
    """

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, *,
                 keep: bool, rounding: Rounding = Rounding.NEAREST, seed: int = 0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
            raise ValueError(f"chunk_bytes must be a positive int (bytes of fp32 transients per optimizer "
                             f"call, e.g. {DEFAULT_CHUNK_BYTES}), got {chunk_bytes!r}")
        self.model_params = list(params)
        self.keep = keep
        self.rounding = rounding
        self.chunk_bytes = chunk_bytes
        self._workspace: torch.Tensor | None = None     # CPU only, see the module docstring
        self._step_plan: list | None = None              # begin_step's chunks (None: one chunk)
        self._planned = False                            # begin_step planned this step
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
        self.generator: torch.Generator | None = None
        if rounding is Rounding.STOCHASTIC:
            device = self.masters[0].device if self.masters else torch.device("cpu")
            self.generator = torch.Generator(device=device).manual_seed(seed)
        if not keep:
            self._release()

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Plan the step's chunks (``step`` uses the plan). Casts nothing; no sync."""
        self._step_plan = self._plan(optimizer)
        self._planned = True

    def grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The gradients for every tensor ``optimizer`` steps, in its order: the model's 16-bit gradient
        for an fp32 copy (whose own is cast chunk by chunk inside ``step``), the tensor's own gradient
        otherwise. No copy, no sync."""
        out = []
        for group in optimizer.param_groups:
            for t in group["params"]:
                i = self._index.get(id(t))
                g = t.grad if i is None else self.model_params[i].grad
                if g is not None:
                    out.append(g)
        return out

    def skip_step(self) -> None:
        """A skipped step: drop the plan and any fp32 gradient; the weights stay as they are."""
        self._planned = False
        for m in self.masters:
            m.grad = None
        if not self.keep:
            self._release()

    def numel_of(self, t: torch.Tensor) -> int:
        """Elements of ``t``; for an fp32 copy, of the weight it stands for (transient ones are empty)."""
        i = self._index.get(id(t))
        return t.numel() if i is None else self.model_params[i].numel()

    def pull_grads(self, which: list[int] | None = None, *, chunked: bool = False) -> None:
        """Cast the model's low-precision gradients into the fp32 copies (and, transient, the weights).

        Casting fp16/bf16 to fp32 is exact: the copies hold what backward made. ``which`` picks copies
        by position (default: all); ``chunked``: they are one chunk of several (CPU: the workspace).
        """
        which = range(len(self.masters)) if which is None else which
        workspace = self._workspace_for(which, chunked)
        offset = 0
        for i in which:
            p, m = self.model_params[i], self.masters[i]
            if not self.keep:
                m.data = p.detach().float()
            if workspace is not None and p.grad is not None:
                m.grad = workspace[offset:offset + p.numel()].view(p.shape)
                m.grad.copy_(p.grad)
                offset += p.numel()
            elif p.grad is None:
                m.grad = None
            elif m.grad is None or m.grad.shape != p.grad.shape:
                m.grad = p.grad.float()
            else:
                m.grad.copy_(p.grad)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the fp32 gradient workspace kept between steps (CPU, large chunks only; else 0)."""
        return 0 if self._workspace is None else self._workspace.untyped_storage().nbytes()

    def _workspace_for(self, which, chunked: bool) -> torch.Tensor | None:
        if not self.keep or not self.masters or self.masters[0].device.type != "cpu":
            return None
        need = sum(self.model_params[i].numel() for i in which if self.model_params[i].grad is not None
                   and self.model_params[i].grad.layout == torch.strided)
        if 4 * need < _WORKSPACE_MIN and not chunked:
            # Kept nothing between steps, but still one flat block for the chunk's casts: glibc reuses
            # one freed block, where many freed together were handed back to the kernel and faulted in
            # again each step (measured: one-chunk steps 1.5-2x slower at random).
            return torch.empty(need, dtype=torch.float32, device=self.masters[0].device) if need else None
        if self._workspace is None or self._workspace.numel() < need:   # kept: at most the largest chunk
            self._workspace = torch.empty(need, dtype=torch.float32, device=self.masters[0].device)
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
        if plan is None:            # everything fits one chunk: the optimizer's groups stay as built
            everything = list(range(len(self.masters)))
            self._step_chunk(optimizer, everything, step_fn, inv_divisor, chunked=False)
            return
        groups = optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for chunk in plan:
                for group, members in zip(groups, chunk):
                    group["params"] = members
                self._step_chunk(optimizer, self._positions(chunk), step_fn, inv_divisor, chunked=True)
        finally:
            for group, members in zip(groups, saved):
                group["params"] = members

    def _positions(self, chunk: list[list[torch.Tensor]]) -> list[int]:
        """The positions of a chunk's fp32 copies (its fp32 tensors of the model's own have none)."""
        return [self._index[id(t)] for members in chunk for t in members if id(t) in self._index]

    def _step_chunk(self, optimizer, which: list[int], step_fn, inv_divisor, chunked: bool) -> None:
        self.pull_grads(which, chunked=chunked)
        if inv_divisor is not None:
            # fp32 copies and fp32 model gradients alike: the optimizer sees grad * clip / S.
            grads = [t.grad for g in optimizer.param_groups for t in g["params"] if t.grad is not None]
            if grads:
                torch._foreach_mul_(grads, inv_divisor)
        step_fn()
        self.push_weights(which)
        for i in which:     # the fp32 gradients (and transient weights) go before the next chunk comes
            self.masters[i].grad = None

    def _plan(self, optimizer) -> list[list[list[torch.Tensor]]] | None:
        """The optimizer's tensors cut into chunks of at most ``chunk_bytes`` of fp32 transients, each
        chunk one list per param group; None when one chunk holds them all."""
        per_element = 4 if self.keep else 8      # an fp32 gradient, plus an fp32 weight when transient
        sizes = {id(m): per_element * m_p.numel() for m, m_p in zip(self.masters, self.model_params)}
        if sum(sizes.values()) <= self.chunk_bytes:
            return None
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
    def push_weights(self, which: list[int] | None = None) -> None:
        """Round the fp32 copies into the model's weights (nearest, or stochastic for bf16-sr).

        Rounding an unchanged copy gives back the model's weight bit for bit, so this is safe to run
        after a step the optimizer skipped on the device. ``which`` picks copies by position.
        """
        which = list(range(len(self.masters))) if which is None else which
        if not which:
            return
        if self.generator is None:
            torch._foreach_copy_([self.model_params[i].data for i in which],
                                 [self.masters[i].data for i in which])
        else:
            for i in which:
                self.model_params[i].data.copy_(stochastic_round_bf16(self.masters[i].data, self.generator))
        if not self.keep:
            self._release(which)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._planned = False
        for m in self.masters:
            if set_to_none:
                m.grad = None
            elif m.grad is not None:
                m.grad.zero_()

    def _release(self, which: list[int] | None = None) -> None:
        # A transient copy gives its memory back between steps; the optimizer keys state by the
        # Parameter object, which stays.
        for i in range(len(self.masters)) if which is None else which:
            m = self.masters[i]
            m.data = torch.empty(0, dtype=torch.float32, device=m.device)
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().clone() for m in self.masters] if self.keep else None,
                "generator": self.generator.get_state() if self.generator is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
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
                m.data.copy_(saved)
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])


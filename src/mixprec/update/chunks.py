"""The optimizer's step taken chunk by chunk over the fp32 copies (``MasterWeights.step``).

No fp32 gradient is held between steps (the usual 16 B/param with Adam: 2 weights + 2 gradients + 4
master + 8 moments; a small model's few MiB aside: ``transients.py``). ``step`` walks the optimizer's
tensors in chunks of at most ``chunk_bytes`` of fp32 transients (the chunk's gradients, and for
``keep=False`` its weights): it casts the chunk's 16-bit gradients into fp32, lets the optimizer step
only that chunk, rounds the result into the model (``writeback.py``) and frees the transients before the
next chunk. So the step's extra memory is bounded by ``chunk_bytes`` (64 MiB by default; a single tensor
larger than that is its own chunk), and a model whose fp32 copies fit in one chunk steps in one
``optimizer.step()`` call exactly as a plain optimizer would.

The engine reads the global norm before the first chunk steps, from the model's 16-bit gradients
(``grad_norm.GradNorm``: no fp32 copies, ``ChunkedStep.grads``), whatever the chunking: the same tensors
read the same way, so a chunked step's norm, and with it the clip and the skip, is bitwise the one-call
step's.

``ChunkedStep`` is a part of ``master.MasterWeights`` (it steps the copies that class builds and reads
its attributes); it holds no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ChunkedStep", "DEFAULT_CHUNK_BYTES"]

# The fp32 transients of one optimizer call: small next to any model worth chunking (gpt2: 8 chunks),
# large enough that a step makes few calls (a 7B model: ~420, each a multi-tensor kernel on CUDA).
DEFAULT_CHUNK_BYTES = 64 * 2**20


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


class ChunkedStep:
    """``MasterWeights``'s step: the chunks planned, the gradients the norm reads, each chunk cast,
    stepped and rounded into the model, or the step skipped."""

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

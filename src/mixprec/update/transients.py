"""The fp32 transients of a step: flat buffers, their per-tensor views, and what is kept between steps.

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
casts afresh was measured 2-3x slower there (benchmarks/HISTORY.md, page faults on fresh memory; with
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

``Fp32Transients`` is a part of ``master.MasterWeights`` (it fills the copies that class builds and
keeps its buffers on it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .bit_views import Fp32Bits

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Fp32Transients", "kept_gradient_bytes"]

_WORKSPACE_MIN = 32 * 2**20      # CPU: fp32 gradient chunks this large go into a kept workspace
# Any device: a one-chunk step's fp32 transients up to this size stay between steps,
# laid out once (MasterWeights._kept_views, _transient_layout).
_SMALL_KEPT = 4 * 2**20


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


class Fp32Transients:
    """``MasterWeights``'s fp32 transients: the 16-bit gradients (and, transient, weights) cast into
    flat buffers, the kept workspace and layout, and the copies released between steps."""

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

    def _release(self, which) -> None:
        # A transient copy gives its memory back between steps: pointed at one shared empty tensor.
        for i in which:
            m = self.masters[i]
            m.data = self._empty
            m.grad = None
        self._pulled = None

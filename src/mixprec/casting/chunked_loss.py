"""Cross-entropy that keeps the logits in their own dtype and never holds a full fp32 copy of them.

The loss of a language model is computed in fp32 from 16-bit logits (a softmax over 50k+ terms loses
the small ones in 16 bits). ``F.cross_entropy`` under autocast does that by making fp32 log-probabilities
of every position, which autograd then *saves* for the backward: for GPT-2 at batch 12 x 1024 tokens that
is 12,288 x 50,304 x 4 bytes = 2.47 GB, the largest single tensor of the step, twice the 16-bit logits it
came from. Its gradient is a second full fp32 tensor before being cast back to 16 bits.

:func:`cross_entropy` gives the same numbers from less memory. It works through the rows in chunks of
about ``chunk_bytes`` of fp32: the forward computes each chunk's per-row losses in fp32 and keeps
nothing of them; autograd saves only the 16-bit logits (2 bytes a value; fp32 logits that are an
exact cast of 16-bit ones are kept in their 16-bit source dtype) and the targets. The backward recomputes each chunk's fp32 log-softmax and its gradient, and writes that
chunk of the logits' gradient in the logits' dtype. So the fp32 tensors alive at any time are one chunk
(32 MiB by default), not the whole vocabulary times every token.

Numerics, exactly: each chunk runs ``F.cross_entropy(chunk.float(), ..., reduction="none")``, which does
per row what the full call does (log-softmax reduces within a row), and the backward feeds it the same
incoming gradient the full call would (``g / n`` for the mean over ``n`` counted targets). So the
gradient equals ``F.cross_entropy(logits.float(), target)``'s bit for bit; the loss value is the same
sum in another order (within fp32 rounding of it). The tests check both, and the cost: one more
log-softmax over the logits in the backward, small beside the vocabulary matmul that made them.

Class weights and probability targets go to ``F.cross_entropy`` unchanged (whole, in fp32): they are
rare in language models, and a silent approximation would be worse than the memory. So do true fp32
logits that fit in one chunk (an fp32 recipe on a small vocabulary): there saving the logits instead of
the log-probabilities gains nothing and the recomputation would cost one tensor more.

    >>> logits = torch.randn(6, 5, dtype=torch.bfloat16, requires_grad=True)
    >>> target = torch.tensor([0, 1, 2, 3, 4, -100])
    >>> ref = F.cross_entropy(logits.float(), target)
    >>> loss = cross_entropy(logits, target)
    >>> bool(abs(loss - ref) <= 1e-6 * ref)                              # the same sum, in another order
    True
    >>> torch.equal(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0])
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .saved16 import upcast_source

__all__ = ["cross_entropy"]

CHUNK_BYTES = 32 << 20     # fp32 bytes of log-probabilities per chunk: one chunk is alive at a time
_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, *,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                  chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``F.cross_entropy(input.float(), target, ...)`` computed in fp32 chunk by chunk (see the module).

    ``input`` is ``(N, C)`` logits (any float dtype, 16-bit being the point), or ``(N, C, d1, ...)`` as
    ``F.cross_entropy`` takes it (the class dimension is moved last, which copies); ``target`` holds
    class indices. The result is fp32. With ``weight`` or floating (probability) targets it is
    ``F.cross_entropy`` on the fp32 logits, unchunked.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    _check_inputs(input, target)
    try:
        return _cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, chunk_bytes)
    except IndexError as e:    # a CPU kernel's bounds check; CUDA asserts on the device instead
        classes = input.shape[min(1, input.dim() - 1)]
        raise ValueError(f"cross_entropy: a target is not a class index in [0, {classes}) nor "
                         f"ignore_index={ignore_index} (torch: {e})") from None


def _check_inputs(input: torch.Tensor, target: torch.Tensor) -> None:
    """TypeError/ValueError for what F.cross_entropy would refuse deep inside, or accept wrongly: integer
    logits (cast to float, they would give a loss without a gradient) and floating targets that are not
    class probabilities of the logits' shape (class indices must be integers). Metadata only: no sync."""
    for name, t in (("input", input), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cross_entropy: {name} must be a tensor, got {type(t).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"cross_entropy: input must be floating-point logits (N, C), got {input.dtype}; "
                        "pass the model's output, not class ids")
    if target.is_floating_point() and target.shape != input.shape:
        raise ValueError(f"cross_entropy: a floating target holds class probabilities of the logits' shape "
                         f"{tuple(input.shape)}, got {target.dtype} of shape {tuple(target.shape)}; class "
                         "indices must be integers: pass target.long()")


def _cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
                   reduction: str, label_smoothing: float, chunk_bytes: int) -> torch.Tensor:
    if weight is not None or target.is_floating_point() or input.dim() < 2:
        return F.cross_entropy(input.float(), target, weight, ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
    if input.dim() > 2:     # (N, C, d1, ...) -> rows of C, target (N, d1, ...) -> rows
        input = input.movedim(1, -1).reshape(-1, input.shape[1])
        out_shape = target.shape
        target = target.reshape(-1)
    else:
        out_shape = target.shape
    if target.shape[0] != input.shape[0]:
        raise ValueError(f"cross_entropy: {input.shape[0]} rows of logits but {target.shape[0]} targets")
    rows = max(1, chunk_bytes // (4 * max(1, input.shape[1])))
    if rows >= input.shape[0] and input.dtype == torch.float32 and upcast_source(input) is None:
        # True fp32 logits in one chunk: saving the logits instead of the log-probabilities saves
        # nothing, and the recomputation would cost a tensor more at the backward's start.
        loss = F.cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        return loss.reshape(out_shape) if reduction == "none" else loss
    loss = _ChunkedCrossEntropy.apply(input, target, ignore_index, label_smoothing, reduction, rows)
    return loss.reshape(out_shape) if reduction == "none" else loss


def _chunk_losses(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                  label_smoothing: float) -> torch.Tensor:
    """Per-row fp32 losses of one chunk (0 for ignored rows): the op the full call runs, on fewer rows."""
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)


def _chunk_grad(logits: torch.Tensor, target: torch.Tensor, g: torch.Tensor, ignore_index: int,
                label_smoothing: float) -> torch.Tensor:
    """The fp32 gradient of ``sum(g * _chunk_losses(logits))`` with respect to ``logits.float()``.

    Without label smoothing it runs the two backward kernels F.cross_entropy's graph runs, on the same
    values: nll's gradient is ``-g`` at each counted target (``-w * g`` with ``w = 1``, exact) and 0
    elsewhere, then log-softmax's ``d - exp(logp) * sum(d)``. Three chunk-sized fp32 tensors at most.
    With label smoothing (a composite of two terms) autograd differentiates the chunk's own graph.
    """
    if label_smoothing:
        x = logits.detach().float().requires_grad_()
        with torch.enable_grad():
            losses = _chunk_losses(x, target, ignore_index, label_smoothing)
        return torch.autograd.grad(losses, x, g)[0]
    logp = torch.log_softmax(logits.detach().float(), dim=1)
    counted = target != ignore_index
    d = torch.zeros_like(logp)
    d.scatter_(1, torch.where(counted, target, 0).unsqueeze(1), torch.where(counted, -g, 0.0).unsqueeze(1))
    return torch._log_softmax_backward_data(d, logp, 1, logp.dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Saves the logits in their dtype and the targets; recomputes each chunk's fp32 softmax backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                label_smoothing: float, reduction: str, rows: int) -> torch.Tensor:
        per_row = torch.cat([_chunk_losses(logits[s:s + rows], target[s:s + rows], ignore_index,
                                           label_smoothing) for s in range(0, logits.shape[0], rows)])
        # The mean is over the targets that count, like F.cross_entropy's; a device tensor, no sync.
        count = (target != ignore_index).sum().to(torch.float32)
        # fp32 logits that are a cast of 16-bit ones (autocast's, or the CPU output cast) are kept in
        # their 16-bit source dtype: exact, and each chunk is cast up again in the backward.
        source = upcast_source(logits)
        kept = logits.detach().to(source) if source is not None else logits
        if kept is not logits:
            kept._mixprec_producer = "cross_entropy logits"    # how memory_report names it
        ctx.save_for_backward(kept, target, count)
        ctx.dtype = logits.dtype
        ctx.options = (ignore_index, label_smoothing, reduction, rows)
        if reduction == "none":
            return per_row
        total = per_row.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        logits, target, count = ctx.saved_tensors
        ignore_index, label_smoothing, reduction, rows = ctx.options
        # What each row's loss receives: g for a sum, g / n for the mean (one division, as the full
        # call's nll_loss backward makes it), the row's own g for "none".
        row_grad = grad / count if reduction == "mean" else grad
        if rows >= logits.shape[0]:      # one chunk: no output buffer beside the chunk's gradient
            g = row_grad if reduction == "none" else row_grad.expand(logits.shape[0])
            return (_chunk_grad(logits, target, g, ignore_index, label_smoothing).to(ctx.dtype),
                    None, None, None, None, None)
        out = torch.empty(logits.shape, dtype=ctx.dtype, device=logits.device)
        for s in range(0, logits.shape[0], rows):
            g = row_grad[s:s + rows] if reduction == "none" else row_grad.expand(min(rows, logits.shape[0] - s))
            # The chunk's gradient in the logits' dtype, as autograd's cast of the fp32 one would give it.
            out[s:s + rows] = _chunk_grad(logits[s:s + rows], target[s:s + rows], g, ignore_index,
                                          label_smoothing)
        return out, None, None, None, None, None

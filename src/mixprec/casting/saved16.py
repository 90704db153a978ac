"""Saved activations that are really 16-bit: what autograd keeps for the backward, in 16 bits where it can.

Under a 16-bit recipe some tensors autograd saves are still fp32 (``mixprec inspect`` names them):

- *exact upcasts*: an fp32 copy of a 16-bit tensor, made because the next op runs in fp32 (the input
  of a norm a pure recipe keeps fp32, autocast's casts for its fp32 ops). Its values are 16-bit values,
  so keeping the 16-bit copy instead loses nothing: the backward gets the same fp32 numbers back.
- *computed in fp32*: the fp32 residual stream of an autocast recipe (fp32 embeddings plus 16-bit
  branch outputs promote to fp32), log-softmax outputs of the fp32 loss. Rounding these to bf16 for the
  backward is a real, if small, change: the backward sees them with bf16's 8-bit mantissa.

``Saved`` (the recipe's ``saved=`` key) picks the policy: ``fp32`` (the default) keeps everything as
autograd made it; ``exact`` stores exact upcasts in their 16-bit source dtype, losslessly, and trains bit
for bit like torch.autocast; ``low`` also rounds the other differentiable fp32 activations made under
autocast to bf16 (bf16: fp32's range, so nothing overflows). Not rounded, whatever the policy: softmax and
log-softmax outputs (the backward takes their exponential, which would carry bf16's error times the
log-probability), tensors saved inside a region the recipe keeps in fp32 (autocast is off there), norm
statistics and other tensors without a ``grad_fn``.

Why ``fp32`` is the default: a recipe torch.amp also offers must give torch.amp's numbers at torch.amp's
speed unless the user asks for more. ``low`` changes the gradients (within bf16's rounding) and ``exact``,
though lossless, runs a Python pack and unpack per saved tensor plus a cast each way: a 2-layer GPT's
step under ``low`` dispatched 481 aten ops against 427 with ``fp32``, and issue 22 measured a 4-layer LM's
step 1.06-1.09x torch.amp's on a CPU with ``low`` the default, 1.007x with ``fp32``. What
they buy is memory: under an autocast recipe the residual stream of a transformer is fp32 (fp32
embeddings plus 16-bit branch outputs) and every norm saves its input; those fp32 saves are a sixth of
gpt2's activations under bf16. Ask for them by name (``bf16,saved=low``) where activations bound the batch
(``docs/memory.md`` has the measured saving and cost).

Under ``torch.compile`` the policy applies to what runs eagerly: a compiled region saves what its own
graph decides (AOTAutograd's partitioner picks and stores its saved tensors inside the graph), so
``saved=`` does not change a compiled model's numbers; the engine says so once.

``SavedPacker`` is the ``saved_tensors_hooks`` pair that does it; the engine enters it inside
``autocast()``. It composes with hooks entered around it (``SavedTensorMeter`` counts the packed 16-bit
tensors). No host sync; one cast per packed tensor in the forward and one back to fp32 per use in the
backward.

    >>> a = torch.randn(4, requires_grad=True)
    >>> with SavedPacker(Saved.EXACT):
    ...     y = (a.to(torch.bfloat16) * 2).float().exp()     # exp saves its fp32 output: not a cast
    >>> y.grad_fn._saved_result.dtype
    torch.float32
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Saved", "SavedPacker", "upcast_source", "warn_if_compiled_saves", "SavedPolicyWarning"]

_LOW = (torch.float16, torch.bfloat16)


class Saved(enum.Enum):
    """Which fp32 activations a 16-bit recipe saves in 16 bits (``saved=`` in a recipe string)."""

    FP32 = "fp32"     # as autograd made them (the default): torch.autocast's numbers and speed
    EXACT = "exact"   # exact upcasts of 16-bit tensors kept in 16 bits: lossless, less memory, Python per save
    LOW = "low"       # and other fp32 activations made under autocast rounded to bf16: lossy, least memory

    @classmethod
    def parse(cls, word: str) -> Saved:
        try:
            return cls(word.strip().lower())
        except ValueError:
            raise ValueError(f"unknown saved {word!r}; valid values: {', '.join(s.value for s in cls)} "
                             "(fp32, the default: as autograd saves them; exact: upcasts kept in 16 bits, lossless; low: "
                             "fp32 activations also rounded to bf16 for the backward)"
                             ) from None


# Autograd nodes of ops whose result holds some of their input's values unchanged (views, copies of a
# part): a view of an upcast still holds 16-bit values.
_VIEW_NODES = ("ViewBackward", "ReshapeAliasBackward", "UnsafeViewBackward", "TBackward", "TransposeBackward",
               "PermuteBackward", "SliceBackward", "SelectBackward", "ExpandBackward", "SqueezeBackward",
               "UnsqueezeBackward", "AliasBackward", "CloneBackward")


def upcast_source(t: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype ``t``'s values were cast up from, when ``t`` is an fp32 cast of a 16-bit tensor
    (or a view of one); else None. Then ``t.to(that dtype)`` is exact and ``.float()`` gives ``t`` back.

    Autograd records the cast as ``ToCopyBackward0``; the node that made its source records the source's
    dtype in its input metadata (torch 2.5+; older torch: None, nothing is packed).
    """
    fn = t.grad_fn
    if t.dtype != torch.float32 or fn is None:
        return None
    while fn is not None and fn.name().startswith(_VIEW_NODES) and fn.next_functions:
        fn = fn.next_functions[0][0]
    if fn is None or not fn.name().startswith("ToCopyBackward"):
        return None
    source, index = fn.next_functions[0] if fn.next_functions else (None, 0)
    metadata = getattr(source, "_input_metadata", None) if source is not None else None
    if not metadata or index >= len(metadata):
        return None
    dtype = metadata[index].dtype
    return dtype if dtype in _LOW else None


def _upcast_source(t: torch.Tensor) -> torch.dtype | None:
    """``upcast_source`` for the packer, which keeps views as autograd saved them (a view's 16-bit copy
    would be a second tensor beside its base's)."""
    return None if t._base is not None else upcast_source(t)


# Outputs whose backward exponentiates them: exp(round(logp)) = p * (1 + |logp| * 2**-9) at worst.
_KEEP_FP32 = ("SoftmaxBackward", "LogSoftmaxBackward")


def _roundable(t: torch.Tensor) -> bool:
    """Whether ``saved=low`` may round this fp32 activation to bf16: made by a differentiable op, not a
    (log-)softmax, under autocast (an fp32 region of the recipe turns autocast off)."""
    if t.grad_fn is None or t.grad_fn.name().startswith(_KEEP_FP32):
        return False
    try:
        return torch.is_autocast_enabled(t.device.type)
    except TypeError:      # torch < 2.4: one switch for CUDA, another for CPU
        return torch.is_autocast_cpu_enabled() if t.device.type == "cpu" else torch.is_autocast_enabled()


class SavedPacker:
    """``saved_tensors_hooks`` that keep fp32 activations in 16 bits per ``policy``; a context manager."""

    def __init__(self, policy: Saved) -> None:
        self.policy = policy
        # One 16-bit copy per fp32 tensor, however many ops save it. The weak reference tells a live
        # storage from a freed one whose address a new tensor reuses.
        self._cache: dict[Any, tuple[StorageWeakRef, torch.Tensor]] = {}
        self._outer: Any = None
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        packed, upcast = t, False
        if t.dtype == torch.float32 and self.policy is not Saved.FP32:
            dtype, label = _upcast_source(t), "cast"
            if dtype is None and self.policy is Saved.LOW and _roundable(t):
                dtype, label = torch.bfloat16, t.grad_fn.name().rsplit("Backward", 1)[0]
            if dtype is not None:
                ref = StorageWeakRef(t.untyped_storage())
                key = (ref.cdata, t.storage_offset(), t.shape, t.stride())
                hit = self._cache.get(key)
                if hit is not None and not hit[0].expired():
                    packed = hit[1]
                else:
                    with torch.no_grad():
                        packed = t.detach().to(dtype)      # exact for an upcast; one rounding otherwise
                    packed._mixprec_producer = label       # for SavedTensorMeter's split by op
                    self._cache[key] = (ref, packed)
                upcast = True
        if self._outer is not None:
            packed = self._outer[0](packed)
        return packed, upcast

    def _unpack(self, saved: Any) -> torch.Tensor:
        packed, upcast = saved
        if self._outer is not None:
            packed = self._outer[1](packed)
        return packed.float() if upcast else packed

    def __enter__(self) -> SavedPacker:
        self._outer = _top_hooks()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._cache.clear()      # the saved graph holds what it packed; the cache only deduplicates


class SavedPolicyWarning(UserWarning):
    """``saved=exact|low`` does not reach into a ``torch.compile``'d region of the model."""


def warn_if_compiled_saves(loss: torch.Tensor, policy: Saved, limit: int = 100_000) -> bool:
    """Warn, and return True, when ``loss``'s autograd graph holds a compiled region (a
    ``CompiledFunctionBackward`` node): what that region saves, its graph decides, and ``policy`` does
    not change it, so compiled and eager runs would differ without a word. Walks at most ``limit``
    nodes; the engine calls it on the first backward only (Python, no device work)."""
    seen, stack = set(), [loss.grad_fn]
    while stack and len(seen) < limit:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn.name().startswith("CompiledFunctionBackward"):
            warnings.warn(f"saved={policy.value} applies to the eager parts of the model only: a "
                          "torch.compile'd region saves what its graph decides, in the dtypes the forward "
                          "made (compiled runs train as with saved=exact, which is lossless). Use "
                          "saved=fp32 (the default) to silence this, or run the model eagerly for "
                          f"saved={policy.value}'s memory saving", SavedPolicyWarning, stacklevel=3)
            return True
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return False


def _top_hooks() -> Any:
    """The (pack, unpack) pair entered around us, to chain to (a SavedTensorMeter), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except TypeError:        # older signature without the tracing flag
        return top()

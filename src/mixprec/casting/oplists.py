"""Op lists: which ops run in 16 bits, which stay fp32, which follow their inputs; and how to edit them.

Mixed precision is classically described by three op lists (16-bit, fp32, follow the inputs). torch.autocast keeps them in C++: each op it casts
has a kernel registered under the ``AutocastCPU`` / ``AutocastCUDA`` dispatch key, with a policy that
is not exposed to Python. mixprec reads them on the device in use, when asked (never at import): the
dispatcher lists the ops registered for that key, and each is probed once on 2x2 *fake* tensors of the
device under autocast, to see which way autocast casts it (no GPU needed for the CUDA lists;
``oplist_probe.py`` says how). Every op without an autocast kernel follows its inputs. A library's own
ops registered for autocast (torchvision's ``torchvision::nms``) are listed under their qualified name,
so they never shadow an aten op of the same base name; an op the probe cannot call is left off the
lists and named, with the reason, in ``OpLists.unprobed``.

    >>> lists = autocast_op_lists("cpu", torch.bfloat16)
    >>> "bmm" in lists.low, "nll_loss" in lists.fp32, "cat" in lists.follow
    (True, True, True)
    >>> default_policy("softmax", "cpu", torch.bfloat16)   # CPU autocast leaves softmax alone
    <OpPolicy.FOLLOW: 'follow'>
    >>> default_policy("softmax", "cuda", torch.float16)   # CUDA autocast runs it in fp32 (no GPU needed)
    <OpPolicy.FP32: 'fp32'>

Editing: a recipe moves ops between the lists (``fp32_ops=softmax+layer_norm,low_ops=bmm``). The edits
that differ from autocast's own policy on the device are applied by ``OpListMode``, a
``torch.overrides.TorchFunctionMode``. Why that one, and not torch's own hooks:

- Re-registering autocast kernels (``torch.library.Library("aten", "IMPL")`` on ``AutocastCPU``) costs
  nothing for untouched ops, but it is process-global (two models with different edits would fight),
  it replaces torch's kernel for the whole process, and torch warns on every override.
- A ``TorchDispatchMode`` sees ops below autograd: a cast there is invisible to autograd, and the
  backward would run in the wrong dtype.
- A ``TorchFunctionMode`` is scoped to a ``with`` block and sits above autograd, so its casts are
  ordinary differentiable ``.to()`` calls. It costs one Python call per torch function in the forward
  pass (the backward runs in C++ and is untouched); benchmarks/host/bench_oplists.py measures that.

With the default lists nothing is installed: no mode, no per-op Python work.

An edit applies to the torch functions a model calls (``F.softmax``, ``torch.bmm``, ``x @ w``,
``Tensor.softmax``), not to ops that a fused C++ op performs inside itself (the softmax inside
``F.scaled_dot_product_attention`` or ``F.cross_entropy``); ``mixprec trace`` shows what ran.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

# The probe of each op's policy; like this module it imports nothing of mixprec (the recipe reads
# OpPolicy and check_op_names from here), and it answers with OpPolicy's values, not its members.
from .oplist_probe import autocast_key, base_name, fake_mode, list_name, op_namespace, probed_policies, quiet_stderr

__all__ = ["OpPolicy", "OpLists", "autocast_op_lists", "default_policy", "check_op_names",
           "effective_edits", "op_list_mode", "OpListMode"]


class OpPolicy(enum.Enum):
    """What an op does under autocast: run in 16 bits, run in fp32, or follow (widest of) its inputs."""

    LOW = "low"
    FP32 = "fp32"
    FOLLOW = "follow"


@dataclasses.dataclass(frozen=True)
class OpLists:
    """autocast's lists for one device type, as probed: ``low`` and ``fp32`` ops, and the ``follow`` ops
    autocast promotes to their widest input dtype. Ops on no list also follow their inputs."""

    device_type: str
    low: frozenset[str]
    fp32: frozenset[str]
    follow: frozenset[str]
    # Registered ops the probe could not read: qualified name -> why. They follow their inputs as far
    # as mixprec's edits are concerned (an edit only ever names aten ops: see ``known_op_names``).
    unprobed: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def policy(self, op: str) -> OpPolicy:
        if op in self.low:
            return OpPolicy.LOW
        if op in self.fp32:
            return OpPolicy.FP32
        return OpPolicy.FOLLOW


# Python-level names that reach a differently named aten op or operator; the mode sees ``func.__name__``.
_FUNC_ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__add__": "add", "__radd__": "add",
                 "__sub__": "sub", "__rsub__": "sub", "__mul__": "mul", "__rmul__": "mul",
                 "__truediv__": "div", "__rtruediv__": "div", "__pow__": "pow", "__rpow__": "pow"}
# A user's op name whose autocast registration is under another aten name.
_ATEN_NAMES = {"cross_entropy": "cross_entropy_loss"}


# -------------------------------------------------------------------------------------- names
@functools.cache
def known_op_names() -> frozenset[str]:
    """Every op name an edit may use: public functions of torch, torch.nn.functional and torch.Tensor,
    and the ops autocast registers on any device."""
    names: set[str] = set()
    for namespace in (torch, F, torch.Tensor, torch.linalg, torch.fft):
        prefix = {torch.linalg: "linalg_", torch.fft: "fft_"}.get(namespace, "")
        names.update(prefix + n for n in dir(namespace)
                     if not n.startswith("_") and not n.endswith("_") and callable(getattr(namespace, n)))
    for key in ("AutocastCPU", "AutocastCUDA"):
        # aten's only: an edit applies to the torch functions a model calls, and a library's own op
        # (torchvision::nms) is not one of them.
        names.update(base_name(op) for op in torch._C._dispatch_get_registrations_for_dispatch_key(key)
                     if op_namespace(op) == "aten")
    return frozenset(n for n in names if n[:1].islower())


def check_op_names(names: tuple[str, ...], *, key: str) -> None:
    """ValueError naming the unknown op and its close matches, e.g. ``softmx`` -> ``softmax``."""
    known = known_op_names()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=4, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else \
                "; use torch function names such as softmax, layer_norm, bmm, matmul, linear"
            raise ValueError(f"unknown op {name!r} in {key}{hint}")


def default_policy(op: str, device_type: str, low: torch.dtype) -> OpPolicy:
    """autocast's policy for ``op`` on ``device_type`` with 16-bit dtype ``low``; probes that op only.

    Overloads that disagree (none do in torch 2.x) resolve to the first one in name order.
    """
    policies = probed_policies(device_type, low, _ATEN_NAMES.get(op, op))[0]
    return OpPolicy(policies[0]) if policies else OpPolicy.FOLLOW


@functools.cache
def autocast_op_lists(device_type: str, low: torch.dtype = torch.bfloat16) -> OpLists:
    """torch.autocast's three lists on ``device_type`` (probes every registered op on fake tensors).

    Needs no device: ``autocast_op_lists("cuda")`` answers on a machine without a GPU (the dispatcher
    holds the CUDA registrations in every build). ValueError for a device type this torch build cannot
    represent, or a ``low`` that is not float16 or bfloat16 (autocast lowers to those alone).
    """
    if low not in (torch.float16, torch.bfloat16):
        # float32 would answer with lists no autocast runs (torch.autocast refuses it on a CPU).
        raise ValueError(f"autocast_op_lists(low=...) is the dtype autocast lowers to: torch.float16 or "
                         f"torch.bfloat16, got {low!r}")
    fake_mode(device_type)        # fail early and clearly, not op by op
    names = {list_name(op) for op in torch._C._dispatch_get_registrations_for_dispatch_key(
        autocast_key(device_type))}
    by_policy: dict[OpPolicy, set[str]] = {p: set() for p in OpPolicy}
    unprobed: dict[str, str] = {}
    with quiet_stderr():
        for name in names:
            policies, missed = probed_policies(device_type, low, name)
            unprobed.update(missed)
            if policies:
                by_policy[OpPolicy(policies[0])].add(name)
    return OpLists(device_type, frozenset(by_policy[OpPolicy.LOW]), frozenset(by_policy[OpPolicy.FP32]),
                   frozenset(by_policy[OpPolicy.FOLLOW]), dict(sorted(unprobed.items())))


def effective_edits(edits: Mapping[str, OpPolicy], device_type: str,
                    low: torch.dtype) -> dict[str, OpPolicy]:
    """The edits that change something on ``device_type``: those that differ from autocast's policy."""
    return {op: p for op, p in edits.items() if default_policy(op, device_type, low) is not p}


def op_list_mode(edits: Mapping[str, OpPolicy], device_type: str,
                 low: torch.dtype = torch.bfloat16) -> OpListMode | None:
    """The mode that applies ``edits`` on ``device_type``, or None when none differs from autocast's
    lists (then nothing is installed). ``low`` picks the probe dtype: torch's lists are the same for
    fp16 and bf16 on every device it ships."""
    changed = effective_edits(edits, device_type, low) if edits else {}
    return OpListMode(changed, device_type) if changed else None


# ---------------------------------------------------------------------------------- the mode
class OpListMode(TorchFunctionMode):
    """Applies op-list edits on top of torch.autocast, for the torch functions named in ``edits``.

    An edited op runs with autocast off for that one call, on inputs cast to its dtype: the 16-bit
    dtype of the autocast region it is in (``low``), fp32 (``fp32``), or the widest floating dtype
    among its inputs (``follow``). That is exactly a manual ``op(x.to(dtype))`` outside autocast, so
    its output is bitwise what that call gives. Every other function passes straight through. Outside
    an autocast region (a module kept fp32) edits do nothing. No host sync.

        with torch.autocast("cpu", dtype=torch.bfloat16), OpListMode({"softmax": OpPolicy.FP32}, "cpu"):
            y = torch.softmax(x, -1)     # float32, == torch.softmax(x.float(), -1)
    """

    def __init__(self, edits: Mapping[str, OpPolicy], device_type: str) -> None:
        super().__init__()
        self.edits = dict(edits)
        self.device_type = device_type
        self._policy_of: dict[Any, OpPolicy | None] = {}   # func -> policy, filled as funcs are seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            policy = self._policy_of[func]
        except (KeyError, TypeError):      # TypeError: an unhashable callable (never edited)
            name = getattr(func, "__name__", None)
            policy = self.edits.get(_FUNC_ALIASES.get(name, name)) if isinstance(name, str) else None
            try:
                self._policy_of[func] = policy
            except TypeError:
                pass
        if policy is None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        if policy is OpPolicy.LOW:
            dtype = torch.get_autocast_dtype(self.device_type)
        elif policy is OpPolicy.FP32:
            dtype = torch.float32
        else:
            floating = [t.dtype for t in tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor) and t.is_floating_point()]
            dtype = functools.reduce(torch.promote_types, floating) if floating else None
        if dtype is not None:
            args, kwargs = tree_map(lambda t: self._cast(t, dtype), (args, kwargs))
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **kwargs)

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        # Only floating tensors on this device type: autocast casts the same ones (integer ids,
        # masks and CPU scalars on a CUDA run keep their dtype).
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype
                and value.device.type == self.device_type):
            return value.to(dtype)
        return value

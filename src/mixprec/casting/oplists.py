"""Op lists: which ops run in 16 bits, which stay fp32, which follow their inputs; and how to edit them.

Mixed precision is classically described by three op lists (16-bit, fp32, follow the inputs). torch.autocast keeps them in C++: each op it casts
has a kernel registered under the ``AutocastCPU`` / ``AutocastCUDA`` dispatch key, with a policy that
is not exposed to Python. mixprec reads them in two steps, on the device in use, when asked (never at
import):

1. *Which* ops autocast handles: ``torch._C._dispatch_get_registrations_for_dispatch_key`` lists the
   ops with a kernel for that key (the CPU build lists the CUDA registrations too).
2. *What* it does to each: we call the op on 2x2 *fake* tensors of that device (``FakeTensorMode``:
   dtypes and shapes, no data; no GPU needed for the CUDA lists) with autocast on and a
   ``TorchDispatchMode`` underneath. Autocast's dispatch key sits above the Python one, so the mode sees
   the op's arguments right after autocast's casts and records their dtypes; a second call looks at the
   dtype the op returns. fp32 inputs cast to 16 bits, or a 16-bit result: *low*. 16-bit inputs cast
   (or a ``dtype=`` set) to fp32, or an fp32 result: *fp32* (on CUDA softmax gets ``dtype=float32``
   and runs ``_softmax(x_fp16, half_to_float=True)``: only the result tells). Mixed inputs widened to
   fp32 or passed as they are (autocast's "promote" list, e.g. ``cat``, ``stack``): *follow*. Every op
   without an autocast kernel also follows its inputs.

Libraries register ops of their own for autocast too (torchvision's ``torchvision::nms`` and
``roi_align``, anything made with ``torch.library.register_autocast``). Those are probed the same way
and listed under their qualified name (``"torchvision::nms"``), so they never shadow an aten op of the
same base name; an op the probe cannot call (no fake kernel, an op the dispatcher lists but Python
cannot reach) is left off the lists and named, with the reason, in ``OpLists.unprobed``.

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
  pass (the backward runs in C++ and is untouched); benchmarks/bench_oplists.py measures that.

With the default lists nothing is installed: no mode, no per-op Python work.

An edit applies to the torch functions a model calls (``F.softmax``, ``torch.bmm``, ``x @ w``,
``Tensor.softmax``), not to ops that a fused C++ op performs inside itself (the softmax inside
``F.scaled_dot_product_attention`` or ``F.cross_entropy``); ``mixprec trace`` shows what ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

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
        names.update(_base_name(op) for op in torch._C._dispatch_get_registrations_for_dispatch_key(key)
                     if _namespace(op) == "aten")
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


def _base_name(qualified: str) -> str:
    """``aten::softmax.int`` -> ``softmax``."""
    return qualified.split("::", 1)[-1].split(".", 1)[0]


def _namespace(qualified: str) -> str:
    """``aten::softmax.int`` -> ``aten``; ``torchvision::nms`` -> ``torchvision``."""
    return qualified.split("::", 1)[0] if "::" in qualified else "aten"


def _list_name(qualified: str) -> str:
    """The name an op has in the lists: aten's by base name (``softmax``), every other namespace's
    qualified (``torchvision::nms``), so a library's op never stands for an aten op of the same name."""
    namespace = _namespace(qualified)
    return _base_name(qualified) if namespace == "aten" else f"{namespace}::{_base_name(qualified)}"


class _Unprobed(Exception):
    """An op the dispatcher lists for autocast that the probe cannot call; the message says why."""


def _overload(qualified: str) -> torch._ops.OpOverload:
    """The callable overload of ``ns::name.overload``, or _Unprobed saying why there is none."""
    namespace = _namespace(qualified)
    base, _, overload = qualified.split("::", 1)[-1].partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), base), overload or "default")
    except (AttributeError, RuntimeError) as e:   # registered from C++ with no Python-visible schema
        raise _Unprobed(f"registered for autocast but not reachable as torch.ops.{namespace}.{base}"
                        f"{'.' + overload if overload else ''} ({type(e).__name__})") from None


# ------------------------------------------------------------------------------------- probing
class _Stop(Exception):
    """Raised by the probe mode: the op's arguments have been seen, no kernel needs to run."""


class _FirstCall(TorchDispatchMode):
    """Records the first aten call below autocast (its floating-tensor and dtype arguments), then stops."""

    seen: tuple[list[torch.dtype], list[torch.dtype]] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "prim":     # prim.device, prim.layout: autocast asking a fake tensor's device
            return func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs or {}))
        self.seen = ([a.dtype for a in leaves if isinstance(a, torch.Tensor) and a.is_floating_point()],
                     [a for a in leaves if isinstance(a, torch.dtype)])
        raise _Stop


def _fake_argument(arg: Any, dtype: torch.dtype, device: str) -> Any:
    """A value of the schema's type: 2x2 tensors, 1s, ``False``. Its meaning does not matter: the probe
    only needs autocast's decision, and ops whose fake arguments fail a check are probed no further."""
    kind = str(arg.type)
    if "Tensor" in kind:
        tensor = torch.ones(2, 2, dtype=dtype, device=device)
        return [tensor, tensor] if ("[]" in kind or "List" in kind) else tensor
    if "[]" in kind or "List" in kind:
        return [1]
    return {"int": 1, "SymInt": 1, "float": 1.0, "bool": False, "Scalar": 1, "str": "fro"}.get(kind)


@contextlib.contextmanager
def _autocast_on(device_type: str, low: torch.dtype) -> Iterator[None]:
    """Autocast for ``device_type`` switched on through its thread-local state, the state restored after.

    ``torch.autocast("cuda")`` turns itself off (with a warning) where no GPU is visible; the state
    underneath does not look at the hardware, and the probe's tensors are fake, so the CUDA lists can be
    read on any machine. ``torch.autocast``'s own enter and exit do these same steps.
    """
    enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, low)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)


def _fake_mode(device_type: str) -> FakeTensorMode:
    """Fake tensors (shapes and dtypes, no data, no device memory) on ``device_type``; a clear error
    where this torch build cannot even pretend to have the device."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    try:
        with mode:
            torch.empty(1, device=device_type)
    except Exception as e:       # an unknown device type, or a backend this build was compiled without
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot read autocast's op lists for device type {device_type!r}: this torch "
                         f"build cannot make (fake) tensors there ({first}). Use 'cpu' or 'cuda'") from None
    return mode


def _probe(qualified: str, device: str, low: torch.dtype) -> OpPolicy | None:
    """autocast's policy for one registered op overload, or None if the probe could not tell.

    Two things are read, on fake tensors of ``device`` (no GPU needed, no kernel runs): the first aten
    call below autocast (the arguments it cast, a ``dtype=`` it set) and the dtype the op returns.
    Both are needed: on CUDA autocast puts softmax, log_softmax, sum, prod, cumsum, cumprod and
    linalg_vector_norm on its fp32 list by passing ``dtype=torch.float32``, and softmax then reaches
    ``_softmax(x_fp16, half_to_float=True)``: fp16 arguments, fp32 result.
    """
    op = _overload(qualified)
    fake = _fake_mode(device)

    def call(dtypes: tuple[torch.dtype, ...], stop_at_first: bool):
        """(first call's floating dtypes, its dtype arguments), or the op's floating output dtypes."""
        args, kwargs, i = [], {}, 0
        with fake:
            for arg in op._schema.arguments:
                if arg.has_default_value():
                    continue
                is_tensor = "Tensor" in str(arg.type)
                value = _fake_argument(arg, dtypes[i % len(dtypes)] if is_tensor else torch.float32, device)
                i += is_tensor
                (kwargs.__setitem__(arg.name, value) if arg.kwarg_only else args.append(value))
            mode = _FirstCall()
            try:
                with _autocast_on(device, low), (mode if stop_at_first else contextlib.nullcontext()):
                    out = op(*args, **kwargs)
            except _Stop:
                return mode.seen
            except Exception:   # the fake arguments failed a check
                return None
        if stop_at_first:
            return None
        return [t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]

    # The whole op runs (second call of each pair) only where its first aten call did not tell.
    seen = call((torch.float32,), True)
    if seen and (low in seen[1] or low in seen[0]):
        return OpPolicy.LOW
    out = call((torch.float32,), False)
    if out and all(d == low for d in out):
        return OpPolicy.LOW
    seen = call((low,), True)
    if seen and (torch.float32 in seen[0] or torch.float32 in seen[1]):
        return OpPolicy.FP32
    out = call((low,), False)
    if out and torch.float32 in out:
        return OpPolicy.FP32
    seen = call((torch.float32, low), True)
    if seen and low not in seen[1]:
        # autocast's "promote": mixed inputs run in the widest dtype (a cast to fp32 is seen), or the op
        # gets them as they are (index_put: autocast does not look into its list of indices).
        return OpPolicy.FOLLOW
    return None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 while deprecated ops are probed: torch.lu, torch.qr and stft print
    their deprecation notices from C++ straight to stderr, past Python's warnings filters."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _autocast_key(device_type: str) -> str:
    return {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU",
            "mps": "AutocastMPS"}.get(device_type, f"Autocast{device_type.upper()}")


@functools.cache
def _probed(device_type: str, low: torch.dtype, name: str) -> tuple[tuple[OpPolicy, ...], dict[str, str]]:
    """The policies of the registered overloads listed as ``name`` (see ``_list_name``), and the
    overloads the probe could not call, each with the reason."""
    registered = sorted(op for op in torch._C._dispatch_get_registrations_for_dispatch_key(
        _autocast_key(device_type)) if _list_name(op) == name)
    found, unprobed = [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # deprecated ops (torch.lu, stft's window) warn when called
        for op in registered:
            try:
                found.append(_probe(op, device_type, low))
            except _Unprobed as e:
                unprobed[op] = str(e)
            except Exception as e:     # a library's op may fail in ways aten's never do: name it, go on
                if _namespace(op) == "aten":
                    raise
                first = (str(e).strip().splitlines() or [""])[0]
                unprobed[op] = f"the probe failed: {type(e).__name__}: {first}"
    if registered and not unprobed and all(p is None for p in found) and _namespace(registered[0]) != "aten":
        # aten ops whose fake arguments fail a check are known to follow (they were always left off);
        # a library's op that answers nothing is worth naming: most often it has no fake kernel.
        unprobed.update({op: "the probe could not call it on fake tensors (it has no fake/meta "
                             "kernel, or arguments the probe cannot make up)" for op in registered})
    return tuple(p for p in found if p is not None), unprobed


def default_policy(op: str, device_type: str, low: torch.dtype) -> OpPolicy:
    """autocast's policy for ``op`` on ``device_type`` with 16-bit dtype ``low``; probes that op only.

    Overloads that disagree (none do in torch 2.x) resolve to the first one in name order.
    """
    policies = _probed(device_type, low, _ATEN_NAMES.get(op, op))[0]
    return policies[0] if policies else OpPolicy.FOLLOW


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
    _fake_mode(device_type)       # fail early and clearly, not op by op
    names = {_list_name(op) for op in torch._C._dispatch_get_registrations_for_dispatch_key(
        _autocast_key(device_type))}
    by_policy: dict[OpPolicy, set[str]] = {p: set() for p in OpPolicy}
    unprobed: dict[str, str] = {}
    with _quiet_stderr():
        for name in names:
            policies, missed = _probed(device_type, low, name)
            unprobed.update(missed)
            if policies:
                by_policy[policies[0]].add(name)
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

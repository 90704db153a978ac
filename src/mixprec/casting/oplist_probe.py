"""Reading autocast's policy for each op it registers, on fake tensors of a device: the probe behind ``oplists.py``.

torch.autocast keeps its op lists in C++: each op it casts has a kernel registered under the
``AutocastCPU`` / ``AutocastCUDA`` dispatch key, with a policy that is not exposed to Python. This module
reads them in two steps, on the device in use, when asked (never at import):

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
and listed under their qualified name (``"torchvision::nms"``, see ``list_name``), so they never shadow
an aten op of the same base name; an op the probe cannot call (no fake kernel, an op the dispatcher
lists but Python cannot reach) is returned apart, with the reason (``OpLists.unprobed``).

A policy is answered by its name, ``"low"``, ``"fp32"`` or ``"follow"``: the values of ``OpPolicy``,
which ``oplists.py`` defines and turns these into. The recipe reads that vocabulary from ``oplists.py``,
so neither module imports anything of mixprec (tests/test_architecture.py), and this one does not import
``oplists.py`` either.

    >>> list_name("aten::softmax.int"), list_name("torchvision::nms")
    ('softmax', 'torchvision::nms')
    >>> probed_policies("cpu", torch.bfloat16, "bmm")[0]     # the policy of each registered overload
    ('low',)
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["base_name", "op_namespace", "list_name", "autocast_key", "fake_mode", "quiet_stderr",
           "probed_policies"]


# -------------------------------------------------------------------------------------- names
def base_name(qualified: str) -> str:
    """``aten::softmax.int`` -> ``softmax``."""
    return qualified.split("::", 1)[-1].split(".", 1)[0]


def op_namespace(qualified: str) -> str:
    """``aten::softmax.int`` -> ``aten``; ``torchvision::nms`` -> ``torchvision``."""
    return qualified.split("::", 1)[0] if "::" in qualified else "aten"


def list_name(qualified: str) -> str:
    """The name an op has in the lists: aten's by base name (``softmax``), every other namespace's
    qualified (``torchvision::nms``), so a library's op never stands for an aten op of the same name."""
    namespace = op_namespace(qualified)
    return base_name(qualified) if namespace == "aten" else f"{namespace}::{base_name(qualified)}"


class _Unprobed(Exception):
    """An op the dispatcher lists for autocast that the probe cannot call; the message says why."""


def _overload(qualified: str) -> torch._ops.OpOverload:
    """The callable overload of ``ns::name.overload``, or _Unprobed saying why there is none."""
    namespace = op_namespace(qualified)
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


def fake_mode(device_type: str) -> FakeTensorMode:
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


def _probe(qualified: str, device: str, low: torch.dtype) -> str | None:
    """autocast's policy for one registered op overload, or None if the probe could not tell.

    Two things are read, on fake tensors of ``device`` (no GPU needed, no kernel runs): the first aten
    call below autocast (the arguments it cast, a ``dtype=`` it set) and the dtype the op returns.
    Both are needed: on CUDA autocast puts softmax, log_softmax, sum, prod, cumsum, cumprod and
    linalg_vector_norm on its fp32 list by passing ``dtype=torch.float32``, and softmax then reaches
    ``_softmax(x_fp16, half_to_float=True)``: fp16 arguments, fp32 result.
    """
    op = _overload(qualified)
    fake = fake_mode(device)

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
        return "low"
    out = call((torch.float32,), False)
    if out and all(d == low for d in out):
        return "low"
    seen = call((low,), True)
    if seen and (torch.float32 in seen[0] or torch.float32 in seen[1]):
        return "fp32"
    out = call((low,), False)
    if out and torch.float32 in out:
        return "fp32"
    seen = call((torch.float32, low), True)
    if seen and low not in seen[1]:
        # autocast's "promote": mixed inputs run in the widest dtype (a cast to fp32 is seen), or the op
        # gets them as they are (index_put: autocast does not look into its list of indices).
        return "follow"
    return None


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
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


def autocast_key(device_type: str) -> str:
    """The dispatch key that holds autocast's kernels for ``device_type``: ``AutocastCPU``, ``AutocastCUDA``."""
    return {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU",
            "mps": "AutocastMPS"}.get(device_type, f"Autocast{device_type.upper()}")


@functools.cache
def probed_policies(device_type: str, low: torch.dtype, name: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The policies of the registered overloads listed as ``name`` (see ``list_name``), and the
    overloads the probe could not call, each with the reason."""
    registered = sorted(op for op in torch._C._dispatch_get_registrations_for_dispatch_key(
        autocast_key(device_type)) if list_name(op) == name)
    found, unprobed = [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # deprecated ops (torch.lu, stft's window) warn when called
        for op in registered:
            try:
                found.append(_probe(op, device_type, low))
            except _Unprobed as e:
                unprobed[op] = str(e)
            except Exception as e:     # a library's op may fail in ways aten's never do: name it, go on
                if op_namespace(op) == "aten":
                    raise
                first = (str(e).strip().splitlines() or [""])[0]
                unprobed[op] = f"the probe failed: {type(e).__name__}: {first}"
    if registered and not unprobed and all(p is None for p in found) and op_namespace(registered[0]) != "aten":
        # aten ops whose fake arguments fail a check are known to follow (they were always left off);
        # a library's op that answers nothing is worth naming: most often it has no fake kernel.
        unprobed.update({op: "the probe could not call it on fake tensors (it has no fake/meta "
                             "kernel, or arguments the probe cannot make up)" for op in registered})
    return tuple(p for p in found if p is not None), unprobed

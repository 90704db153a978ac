"""Your own workload, named ``package.module:function``: the loader and its protocol.

``mixprec compare --workload my_workloads:tiny`` imports ``my_workloads`` (the current directory comes
first on the path, as with ``python -m``), calls ``tiny()`` with no arguments, and accepts either a
``Workload`` or a dict; see ``tests/user_workload_example.py`` and docs/compare.md. A model may return a
tensor or, as Hugging Face models do, a dict/dataclass with ``logits``: the loss and the metric then
get the logits. Every way a function can break the protocol is a ValueError/TypeError that names the
function and what to return instead.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..model_io import predictions
from .workload import Split, Workload, accuracy

__all__ = ["load_user_workload"]

_REQUIRED = ("model", "data", "loss", "optimizer")
_OPTIONAL = ("metric", "metric_name", "higher_is_better", "batch_size", "steps", "tokens_per_sample",
             "summary")
_PROTOCOL = ("return a mixprec.lab.workloads.Workload, or a dict with 'model' (an nn.Module, or a "
             "function that builds one), 'data' (a Split), 'loss' (loss(outputs, targets) -> tensor) and "
             "'optimizer' (a function of the parameters, e.g. lambda params: torch.optim.AdamW(params, "
             "lr=1e-3))")


def load_user_workload(spec: str) -> Workload:
    """Import ``package.module``, call its ``function()`` and return the ``Workload`` it describes.

    The module is imported as ``python -m`` would, the current directory first. The function takes no
    arguments and returns a ``Workload`` as it is, or a dict (see the module docstring). In the dict:
    a model *instance* is deep-copied for every run, so every recipe starts from its exact weights
    (``--seed`` then fixes only the batch order); a model *function* is called for every run under the
    seed. Anything else is a ValueError/TypeError that names ``spec`` and what to return instead.
    """
    module_name, _, fn_name = spec.strip().partition(":")
    if not module_name or not fn_name.isidentifier():
        raise ValueError(f"workload {spec!r}: expected package.module:function, e.g. my_workloads:tiny, "
                         "naming a function that takes no arguments")
    try:
        with _cwd_on_path():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise   # the module exists but one of its own imports failed: the user's traceback helps
        raise ValueError(f"workload {spec!r}: no module named {module_name!r} in {os.getcwd()} or on "
                         "sys.path; run from the directory that holds it, set PYTHONPATH, or pip install "
                         "its package") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if inspect.isfunction(v)
                        and v.__module__ == module.__name__ and not n.startswith("_"))
        raise ValueError(f"workload {spec!r}: module {module_name!r} has no {fn_name!r}; its functions: "
                         f"{', '.join(public) or 'none'}")
    if not callable(fn):
        raise TypeError(f"workload {spec!r}: {fn_name!r} is {_a(fn)}, not a function; "
                        f"{_PROTOCOL}")
    try:
        required = [p.name for p in inspect.signature(fn).parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):   # builtins without a signature: let the call decide
        required = []
    if required:
        raise TypeError(f"workload {spec!r}: {fn_name}() must take no arguments, it requires {required}; "
                        "give them defaults or wrap it in a function without parameters")
    value = fn()
    if isinstance(value, Workload):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"workload {spec!r}: {fn_name}() returned {_a(value)}; {_PROTOCOL}")
    return _workload_from_dict(spec, value)


def _workload_from_dict(spec: str, d: dict[str, Any]) -> Workload:
    where = f"workload {spec!r}"
    unknown = [k for k in d if k not in _REQUIRED + _OPTIONAL]
    if unknown:
        hints = {k: difflib.get_close_matches(str(k), _REQUIRED + _OPTIONAL, n=1) for k in unknown}
        said = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "")
                         for k in unknown)
        raise ValueError(f"{where}: unknown keys {said}; the keys are {', '.join(_REQUIRED + _OPTIONAL)}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"{where}: the dict lacks {missing}; {_PROTOCOL}")

    model, data = d["model"], d["data"]
    if isinstance(model, nn.Module):
        pristine = model
        build_model: Callable[[], nn.Module] = lambda: copy.deepcopy(pristine)
    elif callable(model):
        with torch.random.fork_rng(devices=[]):   # a trial build must not move the caller's generator
            pristine = model()
        if not isinstance(pristine, nn.Module):
            raise TypeError(f"{where}: 'model' is a function that returned {_a(pristine)}; "
                            "it must return a torch.nn.Module")
        build_model = model
    else:
        raise TypeError(f"{where}: 'model' is {_a(model)}; give a torch.nn.Module or a "
                        "function that builds one")
    if not isinstance(data, Split):
        raise TypeError(f"{where}: 'data' is {_a(data)}; give "
                        "mixprec.lab.workloads.Split(x_train, y_train, x_test, y_test)")
    if isinstance(d["optimizer"], torch.optim.Optimizer):
        raise TypeError(f"{where}: 'optimizer' is an optimizer already built; give the function that builds "
                        f"one from the parameters, e.g. lambda params: "
                        f"torch.optim.{type(d['optimizer']).__name__}(params, lr=1e-3)")
    for key in ("loss", "optimizer", "metric"):
        if key in d and not callable(d[key]):
            raise TypeError(f"{where}: {key!r} is {_a(d[key])}, not a function")
    if not any(p.requires_grad for p in pristine.parameters()):
        raise ValueError(f"{where}: the model ({type(pristine).__name__}) has no trainable parameters: "
                         "there is nothing to train or inspect; give a model with weights, e.g. nn.Linear")
    optimizer = d["optimizer"](pristine.parameters())   # a trial: it must build an optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: 'optimizer'(params) returned {_a(optimizer)}; it must return "
                        "a torch.optim.Optimizer, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)")
    _check_types(where, d, {"metric_name": str, "summary": str, "higher_is_better": bool})
    for key in ("batch_size", "steps", "tokens_per_sample"):
        v = d.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "tokens_per_sample" else 1):
            raise ValueError(f"{where}: {key!r} must be an integer >= "
                             f"{0 if key == 'tokens_per_sample' else 1}, got {v!r}")
    metric = d.get("metric", accuracy)
    n_params = sum(p.numel() for p in pristine.parameters())
    return Workload(
        name=spec.strip(),
        summary=d.get("summary", f"{type(pristine).__name__} ({n_params:,} parameters) from {spec.strip()}, "
                                 f"{len(data.y_train)} train / {len(data.y_test)} test rows"),
        build_model=build_model, load_data=lambda: data,
        loss_fn=functools.partial(_loss_on_predictions, d["loss"]), make_optimizer=d["optimizer"],
        metric=metric, metric_name=d.get("metric_name", getattr(metric, "__name__", "metric")),
        higher_is_better=d.get("higher_is_better", True), batch_size=d.get("batch_size", 64),
        default_steps=d.get("steps", 500), tokens_per_sample=d.get("tokens_per_sample", 0),
    )


def _loss_on_predictions(loss: Callable[..., Any], outputs: Any, targets: Any) -> Any:
    # A model that returns a dict/dataclass with logits (an HF ModelOutput) hands its logits to the
    # user's loss, in every tool (compare, doctor, inspect, trace); other outputs pass as they are.
    return loss(predictions(outputs), targets)


def _check_types(where: str, d: dict[str, Any], types: dict[str, type]) -> None:
    for key, kind in types.items():
        if key in d and not isinstance(d[key], kind):
            raise TypeError(f"{where}: {key!r} must be {_a(kind)}, got {_a(d[key])}")


def _a(value: object) -> str:
    """'None', or the value's type (or the type itself) with its article: 'a list', 'an int'."""
    if value is None:
        return "None"
    name = value.__name__ if isinstance(value, type) else type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current directory first on ``sys.path`` for the block, as ``python -m`` has it; restored after."""
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path[:] = saved

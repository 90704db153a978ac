"""Issue 24 and 26's bad inputs, and their neighbours, tried again: each must end in a clear error or in
correct behaviour.

Every case is something a careless user does: a recipe string with a scale fp32 cannot hold, a 16-bit
model under an autocast recipe, ``optimizer.step()`` instead of ``mp.step()``, a checkpoint with one field
altered (and a correct checksum), ``mixprec compare --threads 9999``. Each ends in one outcome:

    clear error        a ValueError/TypeError (or a mixprec error type) raised by mixprec, whose message
                       names the problem, with weights, optimizer state and engine state unchanged
    correct behaviour  accepted, and what it then does is checked (the case says what correct is)
    silent wrong       accepted, and it trains or reports wrong without a word (or a CLI exits 0)
    raw traceback      an exception from deep inside torch or Python (AttributeError, KeyError, a torch
                       RuntimeError), a traceback torch logs on the way, or a CLI run that prints a
                       Python traceback or reports as a crash a mistake it should refuse up front
    unclear error      refused, but the message does not name the mistake
    partial change     refused only after something was changed

The cases live in six modules beside this one: ``probe_cases_api.py`` (recipes, the engine's
arguments), ``probe_cases_loop.py`` (the training loop, diagnostics), ``probe_cases_ckpt.py``
(checkpoints, crafted payloads), ``probe_cases_cli.py`` (the ``mixprec`` command line, in process
and a few as real processes) and ``probe_cases_truth.py`` (issue 33: the user's changes, values in
checkpoints, empty fp8 batches, skipped fp8 steps, a binding clip), ``probe_cases_small.py`` (issue
33 continued: the fp8 scale's rounding, the what-if on odd dims, nvfp4 zero blocks, per-layer scale on
tuples and routers). This module holds the outcome rules and the runner::

    .venv/bin/python benchmarks/probe/probe_bad_inputs.py              # the table and the totals
    .venv/bin/python benchmarks/probe/probe_bad_inputs.py -k ckpt -v   # one area, with each case's detail

It runs on one CPU thread, on tiny models, in about 1-1.5 minutes, and exits 1 if any case is not a
clear error or correct behaviour.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import logging
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CLEAR, CORRECT = "clear error", "correct behaviour"
SILENT, RAW, UNCLEAR, PARTIAL = "silent wrong", "raw traceback", "unclear error", "partial change"
OUTCOMES = (CLEAR, CORRECT, SILENT, RAW, UNCLEAR, PARTIAL)
GOOD = (CLEAR, CORRECT)

# Exceptions that are never a message written for the user: they come from inside the code.
_RAW_TYPES = (AttributeError, KeyError, IndexError, NameError, AssertionError, ZeroDivisionError,
              OverflowError, RecursionError, NotImplementedError, StopIteration, UnicodeError, ImportError)


@dataclasses.dataclass
class Outcome:
    kind: str
    detail: str


@dataclasses.dataclass
class Case:
    area: str
    name: str
    run: Callable[[], Outcome]


CASES: list[Case] = []


def case(area: str, name: str) -> Callable[[Callable[[], Outcome]], Callable[[], Outcome]]:
    """Register ``fn`` as a case of ``area``."""
    def register(fn: Callable[[], Outcome]) -> Callable[[], Outcome]:
        CASES.append(Case(area, name, fn))
        return fn
    return register


def add(area: str, name: str, fn: Callable[[], Outcome]) -> None:
    CASES.append(Case(area, name, fn))


# ----------------------------------------------------------------------------- outcome rules
def origin(exc: BaseException) -> str:
    """``file:line`` of the innermost frame that raised ``exc``, shortened."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    name = f.filename
    for marker in ("/mixprec/", "/site-packages/", "/lib/python"):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    return f"{name}:{f.lineno}"


def _from_mixprec(exc: BaseException) -> bool:
    import mixprec
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    name = frames[-1].filename
    # Raised in mixprec (wherever this run imports it from), or at the call site (a Python TypeError
    # for a wrong call signature).
    return name.startswith(os.path.dirname(mixprec.__file__) + os.sep) or "/benchmarks/probe/probe_" in name


def classify_error(exc: BaseException, words: Iterable[str] = ()) -> Outcome:
    """What an exception the user sees is: clear, unclear, or a raw traceback."""
    from mixprec import CheckpointError
    message = " ".join(str(exc).split())
    short = f"{type(exc).__name__} at {origin(exc)}: {message[:160]}"
    if isinstance(exc, _RAW_TYPES) and not isinstance(exc, CheckpointError):
        return Outcome(RAW, short)
    if not isinstance(exc, (ValueError, TypeError, RuntimeError)) or not _from_mixprec(exc):
        return Outcome(RAW, short)
    missing = [w for w in words if w.lower() not in message.lower()]
    if missing:
        return Outcome(UNCLEAR, f"message lacks {missing}: {short}")
    return Outcome(CLEAR, short)


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states (NaN equals NaN; dtypes and shapes must match)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_sparse or b.is_sparse:
            return same(a.to_dense(), b.to_dense())
        return bool(((a == b) | (a != a) & (b != b)).all()) if a.is_floating_point() else torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def refused(call: Callable[[], Any], *words: str, state: Callable[[], Any] | None = None) -> Outcome:
    """The case's input must be refused by ``call`` with a message holding ``words``, changing nothing
    that ``state()`` snapshots."""
    before = copy.deepcopy(state()) if state is not None else None
    try:
        value = call()
    except Exception as exc:   # noqa: BLE001 - the probe classifies whatever comes out
        outcome = classify_error(exc, words)
        if outcome.kind == CLEAR and state is not None and not same(before, state()):
            return Outcome(PARTIAL, f"refused, but after changing state: {outcome.detail}")
        return outcome
    return Outcome(SILENT, f"accepted: returned {_short(value)}")


def correct(ok: bool, what: str) -> Outcome:
    """Correct behaviour if ``ok`` (``what`` says what correct is), else silent wrong."""
    return Outcome(CORRECT if ok else SILENT, what if ok else f"NOT so: {what}")


def warned(record: list[warnings.WarningMessage], *words: str) -> bool:
    """Whether one recorded warning holds every word (case-insensitive)."""
    return any(all(w.lower() in str(r.message).lower() for w in words) for r in record)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


# ----------------------------------------------------------------------------- tiny models, a loop
def tiny(seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    return model.to(dtype) if dtype is not None else model


def batch(seed: int = 1, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def engine(recipe: Any = "fp16", opt: str = "adamw", model: nn.Module | None = None, **kwargs: Any):
    from mixprec import MixedPrecision
    model = tiny() if model is None else model
    optimizer = make_optimizer(opt, model.parameters())
    return MixedPrecision(model, optimizer, recipe, **kwargs)


def make_optimizer(opt: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
            "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
            "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[opt](list(params))


def backward(mp: Any, seed: int = 1) -> torch.Tensor:
    x, y = batch(seed)
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y)
    mp.backward(loss)
    return loss


def train(mp: Any, steps: int = 1, seed: int = 1) -> Any:
    result = None
    for i in range(steps):
        backward(mp, seed + i)
        result = mp.step()
        mp.zero_grad()
    return result


def engine_state(mp: Any) -> dict[str, Any]:
    """Everything a refused call must leave as it was: weights (and dtypes), fp32 copies, the optimizer's
    state and settings, the engine's own state (loss scale and counters)."""
    return {"model": {k: v.detach().clone() for k, v in mp.model.state_dict().items()},
            "optimizer": copy.deepcopy(mp.optimizer.state_dict()),
            "engine": copy.deepcopy(mp.state_dict())}


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- the runner
class _Tracebacks(logging.Handler):
    """Records torch's log records that carry a traceback: the user's terminal shows them as one."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


def run_case(c: Case) -> tuple[Outcome, float]:
    t = time.perf_counter()
    logged = _Tracebacks()
    # torch's loggers keep their own stderr handlers and do not propagate: listen on each.
    torch_logs = [logging.getLogger("torch")] + [
        log for name, log in logging.Logger.manager.loggerDict.items()
        if name.startswith("torch.") and isinstance(log, logging.Logger) and not log.propagate]
    for log in torch_logs:
        log.addHandler(logged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # cases that check warnings record their own
        try:
            outcome = c.run()
        except Exception as exc:   # noqa: BLE001 - escaped the case's own check: classify it
            outcome = classify_error(exc)
            if outcome.kind == CLEAR:     # a correct-behaviour case refused by mixprec: say so
                outcome = Outcome(UNCLEAR, f"refused where it should work: {outcome.detail}")
        finally:
            for log in torch_logs:
                log.removeHandler(logged)
    if logged.records and outcome.kind in GOOD:
        first = logged.records[0]
        outcome = Outcome(RAW, f"torch logged a traceback ({first.name}: {first.getMessage()[:100]}), "
                               f"then: {outcome.detail}")
    return outcome, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only cases whose area or name holds this text")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case's detail")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.modules.setdefault("probe_bad_inputs", sys.modules[__name__])   # one registry, run as a script too
    import probe_cases_api  # noqa: F401 - each registers its cases
    import probe_cases_loop  # noqa: F401
    import probe_cases_ckpt  # noqa: F401
    import probe_cases_cli  # noqa: F401
    import probe_cases_truth  # noqa: F401
    import probe_cases_small  # noqa: F401
    chosen = [c for c in CASES if args.k in c.area or args.k in c.name]
    totals: Counter[str] = Counter()
    start = time.perf_counter()
    print(f"{'area':<9} {'case':<58} outcome")
    for c in chosen:
        outcome, seconds = run_case(c)
        totals[outcome.kind] += 1
        flag = "" if outcome.kind in GOOD else "  <--"
        print(f"{c.area:<9} {c.name[:58]:<58} {outcome.kind}{flag}")
        if args.verbose or outcome.kind not in GOOD:
            print(f"{'':<10}{outcome.detail[:300]}" + (f"  ({seconds:.1f} s)" if seconds > 2 else ""))
    print(f"\n{len(chosen)} cases in {time.perf_counter() - start:.0f} s:")
    for kind in OUTCOMES:
        print(f"  {kind:<18} {totals[kind]}")
    return 0 if all(kind in GOOD for kind in totals) else 1


@contextlib.contextmanager
def captured() -> Any:
    """stdout and stderr as two StringIO, for a CLI run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


@contextlib.contextmanager
def cwd(path: Path) -> Any:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


if __name__ == "__main__":
    sys.exit(main())

"""One line for a run that failed inside the user's model, instead of a 40-line traceback.

A shape mismatch or integer data in the user's own workload raises deep inside torch, after the
progress bars have started. The line names the workload, the module whose ``forward`` was running
and the op (the source line that raised), and how to get the whole traceback::

    mlp: RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x16 and 8x3) in module Linear
    (torch/nn/modules/linear.py:125: return F.linear(input, self.weight, self.bias)); run with
    --traceback (or MIXPREC_TRACEBACK=1) for the full traceback
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from torch import nn

__all__ = ["describe_failure", "wants_traceback"]

_PACKAGE = Path(__file__).resolve().parents[1]     # src/mixprec

TRACEBACK_ENV = "MIXPREC_TRACEBACK"


def wants_traceback(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether ``--traceback`` (anywhere in ``argv``) or ``MIXPREC_TRACEBACK=1`` asks for the full one."""
    flag = "--traceback" in argv
    return flag or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"), [a for a in argv if a != "--traceback"]


def describe_failure(exc: BaseException, workload: str | None) -> str:
    """``workload: Type: first line of the message in module M (file:line: code)``; one line.

    mixprec's own ValueError/TypeError (the loss of a workload that is not one number, say) names the
    mistake itself: its ``raise`` line is left out, it would only show mixprec's source.
    """
    message = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {message[0] if message else ''}".rstrip(": ")
    frames = list(traceback.walk_tb(exc.__traceback__))
    module = next((type(f.f_locals["self"]).__name__ for f, _ in reversed(frames)
                   if f.f_code.co_name == "forward" and isinstance(f.f_locals.get("self"), nn.Module)),
                  None)
    where = ""
    if frames and not _own_message(exc):
        summary = traceback.extract_tb(exc.__traceback__)[-1]
        path = Path(summary.filename)
        short = "/".join(path.parts[-4:]) if "site-packages" in path.parts or "torch" in path.parts \
            else path.name
        where = f"{short}:{summary.lineno}" + (f": {summary.line.strip()}" if summary.line else "")
    place = " in " + " ".join(filter(None, [f"module {module}" if module else "",
                                             f"({where})" if where else ""])) if module or where else ""
    prefix = f"{workload}: " if workload else ""
    return (f"{prefix}{text}{place}; run with --traceback (or {TRACEBACK_ENV}=1) for the full "
            "traceback")


def _own_message(exc: BaseException) -> bool:
    """Whether ``exc`` is a ValueError/TypeError that mixprec raised (its message is written for the user)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (isinstance(exc, (ValueError, TypeError)) and bool(frames)
            and _PACKAGE in Path(frames[-1].filename).resolve().parents)

"""Where the lab's output goes: tables at the terminal's width (every value in full in a pipe), and
Python warnings as the command's own one-line notes."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

from rich.console import Console

__all__ = ["stdout_console", "warnings_as_notes"]

# Piped or redirected (a CI log, `| tee`), rich assumes 80 columns and cuts no_wrap cells to "spe..."
# and scales to "1.67772e+...". A wide virtual width prints each table at its natural width instead:
# rich does not pad lines out to the console's width, so nothing gets longer than its content.
_PIPE_WIDTH = 10_000


def stdout_console() -> Console:
    """A Console on stdout that never truncates a table or wraps its title when stdout is not a tty."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else _PIPE_WIDTH)


@contextlib.contextmanager
def warnings_as_notes() -> Iterator[None]:
    """Inside: each Python warning prints as ``mixprec: note: <message> (<Category>)`` on stderr.

    Python's own format (``.../lab/trainer.py:181: Fp8EmulationWarning: ...`` and then the source line
    ``mp = MixedPrecision(...)``) shows a command-line user mixprec's internals, not their run. The
    filters still decide what shows (each message once per place by default; ``-W error`` raises), and
    ``warnings.catch_warnings`` gives back the previous ``showwarning`` on exit, so the library, used
    from Python, warns as usual.

        >>> with warnings_as_notes():
        ...     warnings.warn("fp8 is emulated")    # stderr: mixprec: note: fp8 is emulated (UserWarning)
    """
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = " ".join(str(message).split())      # one line, however the message was wrapped
        print(f"mixprec: note: {text} ({category.__name__})", file=sys.stderr if file is None else file)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield

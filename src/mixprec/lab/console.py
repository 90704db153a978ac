"""Where the lab's tables go: the terminal's width on a terminal, every value in full in a pipe."""

from __future__ import annotations

import sys

from rich.console import Console

__all__ = ["stdout_console"]

# Piped or redirected (a CI log, `| tee`), rich assumes 80 columns and cuts no_wrap cells to "spe..."
# and scales to "1.67772e+...". A wide virtual width prints each table at its natural width instead:
# rich does not pad lines out to the console's width, so nothing gets longer than its content.
_PIPE_WIDTH = 10_000


def stdout_console() -> Console:
    """A Console on stdout that never truncates a table or wraps its title when stdout is not a tty."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else _PIPE_WIDTH)

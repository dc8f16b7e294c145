"""A status line rewritten in place on a terminal, and the pieces of a progress bar.

Standard library only: the runtime imports it. Callers decide between the terminal form (this
line) and plain lines with `is_terminal`.
"""

from __future__ import annotations

import os
import shutil
from typing import TextIO

from titan.runtime.common import interrupt
from titan.runtime.common.terminal import escape_controls

CLEAR_TO_END = "\x1b[K"


def is_terminal(stream: TextIO) -> bool:
    """True when `stream` is a terminal a person is watching (TERM=dumb counts as not)."""
    return stream.isatty() and os.environ.get("TERM") != "dumb"


def bar(done: int, total: int, *, width: int = 20) -> str:
    filled = width * done // total if total else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def duration(seconds: float) -> str:
    """H:MM:SS, or M:SS under an hour."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StatusLine:
    """One line on a terminal, redrawn with a carriage return, cut to the terminal's width. Its
    control sequences go to the stream under an escaping one (terminal.py); its text is escaped.
    A signal that ends the process while the line is shown moves below it first, so that
    `interrupted` starts a line of its own (in a rank, before its launcher prints it: the
    launcher waits for its ranks to stop)."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.shown = False
        self._forget = lambda: None

    def _write(self, controls: str, text: str = "", end: str = "") -> None:
        raw = getattr(self.stream, "unescaped", self.stream)
        raw.write(controls + escape_controls(text) + end)
        raw.flush()

    def update(self, text: str) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        if not self.shown:
            self._forget = interrupt.on_interrupt(self._leave_on_signal)
        self._write("\r", text[:max(10, width - 1)], CLEAR_TO_END)
        self.shown = True

    def print_above(self, text: str) -> None:
        """A permanent line; the status line is redrawn by the next update."""
        self._write("\r" + CLEAR_TO_END if self.shown else "", text, "\n")
        self._hidden()

    def finish(self) -> None:
        """Leave the last status on screen and move below it."""
        if self.shown:
            self._write("\n")
            self._hidden()

    def _leave_on_signal(self) -> None:
        try:
            self.finish()
        except RuntimeError:  # the signal cut this thread's own write to the stream: go around it
            os.write(getattr(self.stream, "unescaped", self.stream).fileno(), b"\n")

    def _hidden(self) -> None:
        self.shown = False
        self._forget()

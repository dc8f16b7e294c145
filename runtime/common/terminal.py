"""What titan commands write to a terminal: every control character escaped. Standard library only.

Artifacts, checkpoints, metrics files and cache records are untrusted, and their strings
(parameter names, node names, model fields, error details) reach the terminal through the
commands' output: a raw escape sequence in one could retitle the window, hide lines or rewrite
what the user reads (issue 29). So every command's stdout and stderr pass through EscapingStream
(cli/errors.py installs it), which writes any control character but newline and tab as a visible
escape (`\\x1b`, `\\u202e`). titan's own status line (progress.py) is the one writer of control
sequences: it writes them to the stream under the escaping one (`unescaped`), its text escaped."""

from __future__ import annotations

import io
import re

# C0 controls but tab and newline, DEL and C1 controls, and the invisible format characters
# that reorder or hide text (bidirectional overrides and isolates, zero-width marks, BOM).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    return _CONTROLS.sub(_escape, text)


class EscapingStream(io.TextIOBase):
    """A text stream that escapes control characters (escape_controls) on their way to `stream`."""

    def __init__(self, stream):
        self._stream = stream

    @property
    def unescaped(self):
        """The stream written to, for titan's own control sequences (progress.StatusLine)."""
        return self._stream

    def write(self, text: str) -> int:
        self._stream.write(escape_controls(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return self._stream.encoding

    @property
    def errors(self) -> str | None:
        return self._stream.errors


def install() -> None:
    """Escape control characters in everything this process writes through sys.stdout / sys.stderr."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, EscapingStream):
            setattr(sys, name, EscapingStream(stream))

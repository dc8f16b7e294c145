"""Option values checked where they are read, for every command: one `error:` line, exit 2.

`Command` / `Group` make click's own usage errors (a missing argument, an unknown option, a
value outside its type) one line in the form every other titan error has, instead of click's
usage block. The types refuse what click's would let through: NaN and infinities in a float
range (every comparison with NaN is false, so click.FloatRange admits it) and the empty path
(which the filesystem reads as the current directory).
"""

from __future__ import annotations

import math
import os
import sys

import click


class _OneLineErrors:
    def main(self, args=None, prog_name=None, **kwargs):
        kwargs.pop("standalone_mode", None)
        try:
            code = super().main(args, prog_name, standalone_mode=False, **kwargs)
        except click.ClickException as e:
            message = e.format_message().replace("\n", " ").rstrip(".")
            click.echo(f"error: {message[:1].lower()}{message[1:]}; see {prog_name or _program()} --help", err=True)
            sys.exit(2)
        except click.Abort:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def _program() -> str:
    """titan-run for the console script and for `python -m titan.cli.run` alike."""
    name = os.path.basename(sys.argv[0])
    return f"titan-{name[:-3]}" if name.endswith(".py") else name


class Command(_OneLineErrors, click.Command):
    """A titan command: click's usage errors as one `error:` line, exit 2."""


class Group(_OneLineErrors, click.Group):
    """A titan command group (titan-cache): click's usage errors as one `error:` line, exit 2."""


class FiniteFloat(click.ParamType):
    """A finite float above `minimum` (or at least it, with `inclusive`)."""

    name = "float"

    def __init__(self, minimum: float, *, inclusive: bool = False):
        self.minimum, self.inclusive = minimum, inclusive

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        bound = f"{'>=' if self.inclusive else '>'} {self.minimum:g}"
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number (want a number {bound})", param, ctx)
        if number < self.minimum or (number == self.minimum and not self.inclusive):
            self.fail(f"{value!r} is not {bound}", param, ctx)
        return number


class NonEmptyPath(click.Path):
    """click.Path that refuses '' (it would mean the current directory)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path; give a file or directory name", param, ctx)
        return super().convert(value, param, ctx)


POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.IntRange(min=0)
# Seeds feed sha256 (data) and torch generators (init): any non-negative 63-bit integer.
SEED = click.IntRange(min=0, max=2**63 - 1)
LEARNING_RATE = FiniteFloat(0.0)
TIMEOUT = FiniteFloat(1.0, inclusive=True)

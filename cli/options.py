"""The option types of the titan commands: values checked where they are read (a bad one is a
click usage error, which cli/errors.py reports as one `error:` line, exit 2).

They refuse what click's own types would let through: NaN and infinities in a float range
(every comparison with NaN is false, so click.FloatRange admits it) and the empty path (which
the filesystem reads as the current directory).
"""

from __future__ import annotations

import math
import sys

import click


class FiniteFloat(click.ParamType):
    """A finite float above `minimum` (or at least it, with `inclusive`), and at most `maximum`."""

    name = "float"

    def __init__(self, minimum: float, *, inclusive: bool = False, maximum: float | None = None):
        self.minimum, self.inclusive, self.maximum = minimum, inclusive, maximum

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
        if self.maximum is not None and number > self.maximum:
            self.fail(f"{value!r} is more than {self.maximum:g}", param, ctx)
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


COMMAND_ARGS = "titan.command_args"
"""Where the `titan` group leaves a subcommand's own arguments (click's ctx.meta)."""


def command_args() -> list[str]:
    """The arguments this command was given: what ranks it spawns (`python -m titan.cli.run`)
    are given, whether it ran as titan-run or as `titan run`."""
    return click.get_current_context().meta.get(COMMAND_ARGS, sys.argv[1:])


def kernel_trust_options(command):
    """--trust KEYFILE (repeatable) and --trust-unsigned-kernels: whose compiled kernels in an
    artifact a run loads (runtime/kernels/artifact_trust.py); titan-run and titan-verify."""
    command = click.option("--trust-unsigned-kernels", is_flag=True,
                           help="Load the compiled kernels the artifact carries although no key you trust signed it "
                                "(they are GPU code: as trusting a wheel you install).")(command)
    return click.option("--trust", "trust_keys", multiple=True, type=NonEmptyPath(dir_okay=False),
                        help="Load the artifact's compiled kernels when its manifest is signed with this key file "
                             "(titan-build --sign); repeatable. Your own cache key is always trusted.")(command)


def kernel_trust(trust_keys, trust_unsigned_kernels):
    """The KernelTrust the options give, its key files checked (one line if one cannot be used)."""
    from titan.runtime.kernels.artifact_trust import KernelTrust, check_keys

    trust = KernelTrust(keys=tuple(trust_keys), unsigned=trust_unsigned_kernels)
    check_keys(trust)
    return trust

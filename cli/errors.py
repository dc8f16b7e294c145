"""One way for every command to report what the user got wrong: one line, exit status 2."""

from __future__ import annotations

import functools
import sys

import click


def user_errors(fn):
    """Turn ValueError (ArtifactError, bad layouts, bad options) into `error: ...` and exit 2;
    Ctrl-C into `interrupted` and exit 130 (what was written stays consistent: every file is
    put in place by rename)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
    return wrapper

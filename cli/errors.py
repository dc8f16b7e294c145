"""One way for every command to report what the user got wrong: one line, exit status 2.

(Ctrl-C is handled before any command code runs: titan/cli/__init__.py.)"""

from __future__ import annotations

import functools
import sys

import click


def _one_line_usage_error(self, file=None) -> None:
    """click's usage errors (wrong type, unknown option, missing argument) as one line, like
    every other user error, instead of a usage block."""
    cmd = self.ctx.command_path if self.ctx is not None else "the command"
    click.echo(f"error: {self.format_message()} (see {cmd} --help)", err=True)


click.exceptions.UsageError.show = _one_line_usage_error


def user_errors(fn):
    """Turn ValueError (ArtifactError, bad layouts, bad options) into `error: ...` and exit 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except RecursionError:
            click.echo("error: an input nests too deeply to be read; check the files you gave", err=True)
            sys.exit(2)
        except OSError as e:  # a path the checks above did not anticipate (unreadable, full disk, /proc)
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            click.echo(f"error: cannot use{where}: {e.strerror or e}; check the path and its permissions "
                       "(and free space)", err=True)
            sys.exit(2)
    return wrapper

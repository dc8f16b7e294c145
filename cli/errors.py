"""How every titan command reports what the user got wrong: one `error: ... <how to fix>` line on
stderr and exit status 2, never click's usage block or a traceback.

`Command` and `Group` (the class of every titan click command) turn into that line both click's
usage errors (a missing argument, an unknown option, a value outside its type) and what a
command raises for bad input: ValueError (ArtifactError, bad layouts, bad options), OSError (a
path that cannot be used) and RecursionError (an input nested too deeply). Both answer -h as
--help, and every one has --version. (Ctrl-C is handled before any command code runs: titan/cli/__init__.py.)
"""

from __future__ import annotations

import os
import sys

import click

import titan.runtime.common.terminal as terminal
from titan.cli.version import program_name, version_option


class _OneLineErrors:
    def __init__(self, *args, context_settings: dict | None = None, **kwargs):
        settings = {"help_option_names": ["-h", "--help"], **(context_settings or {})}
        super().__init__(*args, context_settings=settings, **kwargs)
        self.params.append(version_option())

    def main(self, args=None, prog_name=None, **kwargs):
        kwargs.pop("standalone_mode", None)
        terminal.install()  # strings from untrusted files reach the terminal escaped
        try:
            code = super().main(args, prog_name, standalone_mode=False, **kwargs)
        except click.ClickException as e:
            message = e.format_message().replace("\n", " ").rstrip(".")
            _fail(f"{message[:1].lower()}{message[1:]}; see {_command_path(e, prog_name or program_name())} --help")
        except ValueError as e:
            _fail(str(e))
        except RecursionError:
            _fail("an input nests too deeply to be read; check the files you gave")
        except OSError as e:  # a path the commands' own checks did not anticipate (unreadable, full disk, /proc)
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            _fail(f"cannot use{where}: {e.strerror or e}; check the path and its permissions (and free space)")
        except click.Abort:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def _command_path(e: click.ClickException, program: str) -> str:
    """The command that went wrong as the user typed it: `titan-cache ls`, `titan run`."""
    names, ctx = [], getattr(e, "ctx", None)
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join([program, *reversed(names)])


class Command(_OneLineErrors, click.Command):
    """A titan command: usage and input errors as one `error:` line, exit 2."""


class Group(_OneLineErrors, click.Group):
    """A titan command group (titan-cache): usage and input errors, its subcommands' included,
    as one `error:` line, exit 2."""

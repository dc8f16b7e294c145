"""Who a titan command is, and --version: the program's name as the user typed it (console
script, `python -m`, or the `titan` group) and the versions it reports."""

from __future__ import annotations

import os
import sys

import click


def program_name() -> str:
    """titan-run for the console script and for `python -m titan.cli.run` alike (titan for the group)."""
    name = os.path.basename(sys.argv[0])
    if not name.endswith(".py"):
        return name
    return "titan" if name == "titan.py" else f"titan-{name[:-3]}"



def version_text(program: str) -> str:
    """'titan-run 0.1.0 (torch 2.13.0+cpu, Python 3.11.7)': from package metadata, without
    importing torch."""
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return (f"{program} {installed('titan-aot')} (torch {installed('torch')}, "
            f"Python {sys.version.split()[0]})")


def version_option() -> click.Option:
    """--version, for every titan command."""
    def show(ctx, param, value):
        if value and not ctx.resilient_parsing:
            click.echo(version_text(program_name() if ctx.parent is None else ctx.command_path))
            ctx.exit()
    return click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True, callback=show,
                        help="Print the version (and torch's) and exit.")

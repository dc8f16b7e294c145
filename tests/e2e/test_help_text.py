"""Every option of every titan command says what it does, every command has a description that
is not its usage line, and every command answers --version (issue 33). In-process over the
click commands themselves, so that a new option without help fails here."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from titan.cli.titan import SUBCOMMANDS
from titan.cli.titan import main as titan_group


def _commands():
    """(path, command) for the group, each titan-* command and each subcommand of a group."""
    yield "titan", titan_group
    for name, command in SUBCOMMANDS.items():
        yield f"titan-{name}", command
        for sub_name, sub in getattr(command, "commands", {}).items():
            yield f"titan-{name} {sub_name}", sub


COMMANDS = list(_commands())


@pytest.mark.parametrize("path, command", COMMANDS, ids=[p for p, _ in COMMANDS])
def test_every_option_has_help_and_the_command_a_description(path, command):
    missing = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert missing == [], f"{path}: options without help: {missing}"
    description = (command.help or "").strip()
    assert description and not description.startswith("titan"), f"{path}: description {description!r}"


def test_the_commands_are_all_covered():
    assert {p for p, _ in COMMANDS} >= {f"titan-{n}" for n in ("build", "run", "verify", "export", "data", "report",
                                                              "cache", "diff", "show")}


@pytest.mark.parametrize("name", ["titan", *(f"titan.cli.{n}" for n in SUBCOMMANDS)])
def test_every_command_prints_its_version(name):
    module = "titan.cli.titan" if name == "titan" else name
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    program = "titan" if name == "titan" else f"titan-{name.rsplit('.', 1)[1]}"
    assert r.returncode == 0 and r.stdout.startswith(f"{program} 0.") and "(torch 2." in r.stdout, r.stdout + r.stderr

"""One `titan` command group: every installed titan-NAME script is `titan NAME`, the same
command object. (Their output and exit status, as processes: e2e/test_titan_command.py.)"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from titan.cli.titan import SUBCOMMANDS

# The commands as installed (pyproject.toml's [project.scripts]).
SCRIPTS = {ep.name: ep.value for ep in entry_points(group="console_scripts") if ep.dist.name == "titan-aot"}


def test_every_titan_script_is_a_titan_subcommand_of_the_same_command():
    scripts = {name.removeprefix("titan-"): target for name, target in SCRIPTS.items() if name != "titan"}
    assert set(scripts) == set(SUBCOMMANDS)
    for name, target in scripts.items():
        module, attr = target.split(":")
        assert SUBCOMMANDS[name] is getattr(importlib.import_module(module), attr), name
    assert SCRIPTS["titan"] == "titan.cli.titan:main"

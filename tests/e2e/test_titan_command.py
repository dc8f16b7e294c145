"""One `titan` command group: `titan NAME ...` is the titan-NAME script, the same command with
the same arguments, output, errors and exit status. (That every script is a subcommand, in
process: unit/test_titan_scripts.py.)"""

from __future__ import annotations

import re

from conftest import titan


def test_a_user_error_is_the_same_line_named_by_the_command_typed(tmp_path):
    grouped, script = titan("titan", "run", tmp_path), titan("run", tmp_path)
    assert grouped.returncode == script.returncode == 2
    assert grouped.stderr == script.stderr
    assert grouped.stderr.count("\n") == 1 and grouped.stderr.startswith("error: ")
    unknown = titan("titan", "cache", "ls", "--bogus")
    assert (unknown.returncode, unknown.stderr) == (2, "error: no such option '--bogus'; see titan cache ls --help\n")


def _losses(stdout: str) -> list[str]:
    return re.findall(r"^step .*\| loss (\S+)", stdout, re.MULTILINE)


def test_titan_run_spawns_its_ranks_with_its_own_arguments(debug_artifact):
    art = debug_artifact(tp=2)
    grouped, script = titan("titan", "run", art, "--steps", 2), titan("run", art, "--steps", 2)
    assert grouped.returncode == script.returncode == 0, grouped.stderr
    assert len(_losses(grouped.stdout)) == 2
    assert _losses(grouped.stdout) == _losses(script.stdout)

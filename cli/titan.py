"""titan: every titan-* command as a subcommand of one command group. `titan build ...` is
`titan-build ...` (the same click command: options, output, errors and exit status), and so on
for run, verify, cache, diff, show, data, report and export."""

from __future__ import annotations

import click

from titan.cli import build, cache, data, diff, export, report, run, show, verify
from titan.cli.errors import Group
from titan.cli.options import COMMAND_ARGS

SUBCOMMANDS = {"build": build.main, "run": run.main, "verify": verify.main, "cache": cache.main,
               "diff": diff.main, "show": show.main, "data": data.main, "report": report.main,
               "export": export.main}


class _Titan(Group):
    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        # What the titan-<name> script would have been given: ranks it spawns get these.
        ctx.meta[COMMAND_ARGS] = list(rest)
        return name, command, rest


@click.group(cls=_Titan, commands=SUBCOMMANDS)
def main():
    """Build an ahead-of-time compiled training artifact, run it on every rank, check it against eager PyTorch.

    `titan COMMAND ...` is the titan-COMMAND script."""


if __name__ == "__main__":
    main()

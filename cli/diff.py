"""titan-diff: what differs between two ranks of one artifact, or one rank of two builds.

Exit status: 0 identical, 1 different, 2 error."""

from __future__ import annotations

import json
import sys
import time

import click

from titan.cli.errors import Command
from titan.cli.options import NON_NEGATIVE

GRAPHS = {"fw": ("forward",), "bw": ("backward",), "all": ("forward", "backward")}


@click.command(cls=Command)
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--ranks", nargs=2, type=NON_NEGATIVE, default=None, help="Two ranks of one artifact.")
@click.option("--rank", type=NON_NEGATIVE, default=0, show_default=True, help="The rank to compare across two builds.")
@click.option("--graph", "graph", default="all", show_default=True, type=click.Choice(list(GRAPHS)),
              help="Which graphs to compare: forward (fw), backward (bw) or both.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--max-lines", default=200, show_default=True, type=click.IntRange(min=0), help="Detail lines shown.")
def main(artifacts, ranks, rank, graph, as_json, max_lines):
    """What differs between two ranks of one artifact (ART --ranks A B) or one rank of two builds
    (ART1 ART2 [--rank R]): their graphs and metadata. Exit 0 identical, 1 different."""
    from titan.cli.tools.graph_diff import diff_ranks
    from titan.runtime.contract.artifact import open_artifact

    t0 = time.perf_counter()
    if len(artifacts) == 1:
        if ranks is None:
            raise ValueError("with one artifact, give --ranks A B (two ranks to compare)")
        left = right = open_artifact(artifacts[0], check_torch=False)
        lr, rr = ranks
    elif len(artifacts) == 2:
        if ranks is not None:
            raise ValueError("with two artifacts, give --rank R (the same rank of both), not --ranks")
        left, right = (open_artifact(a, check_torch=False) for a in artifacts)
        lr = rr = rank
    else:
        raise ValueError("give one artifact with --ranks A B, or two artifacts")
    report = diff_ranks(left, lr, right, rr, graphs=GRAPHS[graph])
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=1))
    else:
        click.echo(f"{report.left}  vs  {report.right}")
        if report.identical:
            click.echo("identical")
        else:
            for line in report.summary():
                click.echo(f"  {line}")
            details = [d.line() for d in report.differences]
            for line in details[:max_lines]:
                click.echo(f"    {line}")
            if len(details) > max_lines:
                click.echo(f"    ... {len(details) - max_lines} more (--max-lines)")
        click.echo(f"({time.perf_counter() - t0:.2f} s)", err=True)
    sys.exit(0 if report.identical else 1)


if __name__ == "__main__":
    main()

"""titan-show: one rank's graph as readable text."""

from __future__ import annotations

import click

from titan.cli.errors import Command
from titan.cli.options import NON_NEGATIVE


@click.command(cls=Command)
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--rank", type=NON_NEGATIVE, default=0, show_default=True, help="The rank whose program to list.")
@click.option("--graph", default="all", show_default=True, type=click.Choice(["fw", "bw", "all"]),
              help="Which graphs to list: forward (fw), backward (bw) or both.")
@click.option("--stage", type=NON_NEGATIVE, default=None,
              help="A pipeline artifact: which of the rank's stages to list (default: its first).")
def main(artifact, rank, graph, stage):
    """List the forward and/or backward graph of one rank."""
    from titan.builder.models.attention import describe_attention
    from titan.cli.tools.graph_listing import list_graph, list_rank_plan
    from titan.runtime.contract.artifact import open_artifact

    from titan.runtime.kernels.artifact_trust import describe_code

    art = open_artifact(artifact, check_torch=False)
    art.rank_coordinates(rank)  # in range
    held = art.manifest.stages_of(rank)
    if stage is not None and stage not in held:
        raise ValueError(f"--stage {stage}: rank {rank} runs " + (f"stage(s) {', '.join(map(str, held))}; pass one "
                         "of them" if held else "the whole model (this artifact has no pipeline); drop --stage"))
    click.echo(describe_code(art))
    click.echo(f"attention: {describe_attention(art.manifest.model_config)}")
    for line in list_rank_plan(art, rank):
        click.echo(line)
    if held:
        from titan.cli.tools.pipeline_collectives import pipeline_collective_lines
        for line in pipeline_collective_lines(art, rank):
            click.echo(line)
    kinds = {"fw": ["forward"], "bw": ["backward"], "all": ["forward", "backward"]}[graph]
    for kind in kinds:
        for line in list_graph(art, rank, kind, stage=stage):
            click.echo(line)


if __name__ == "__main__":
    main()

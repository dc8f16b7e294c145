"""titan-build --pp: the stage split, each stage's share of the model and its peak micro-batches
in flight, and every pp rank's actions. Stage programs are not built yet (issue 28): a pipeline
build prints its plan and stops with the one line that says so."""

from __future__ import annotations

import click

from titan.builder.spec.build_spec import BuildSpec


def show_pipeline_plan(spec: BuildSpec, *, plan_only: bool) -> None:
    if spec.pipeline is None:
        raise ValueError("--pp-plan shows a pipeline; add --pp N (N > 1)")
    record = spec.pipeline.schedule_record()
    layout = spec.layout
    click.echo(f"pipeline of {spec.model} {spec.flavor}: pp {layout.pp} x {layout.world_size // layout.pp} ranks per "
               f"stage [{layout.tag()}], micro-batches of {spec.batch_size} x seq {spec.seq_len}")
    for line in record.table():
        click.echo(line)
    if not plan_only:
        raise ValueError(f"--pp {layout.pp}: stage programs are not built yet (the split and schedule above are "
                         "checked; --pp-plan shows them without this error); build with --pp 1")

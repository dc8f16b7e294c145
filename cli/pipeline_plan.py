"""titan-build --pp-plan: the stage split, each stage's share of the model and its peak
micro-batches in flight, and every pp rank's actions, without building."""

from __future__ import annotations

import click

from titan.builder.spec.build_spec import BuildSpec
from titan.runtime.contract.memory_estimate import GIB, PARAM_STATE_BYTES


def show_pipeline_plan(spec: BuildSpec) -> None:
    if spec.pipeline is None:
        raise ValueError("--pp-plan shows a pipeline; add --pp N (N > 1)")
    record = spec.pipeline.schedule_record()
    layout = spec.layout
    click.echo(f"pipeline of {spec.model} {spec.flavor}: pp {layout.pp} x {layout.world_size // layout.pp} ranks per "
               f"stage [{layout.tag()}], micro-batches of {spec.batch_size} x seq {spec.seq_len}")
    for line in record.table():
        click.echo(line)
    click.echo("memory per rank of each stage (fp32 parameters, gradients and AdamW's two moments, sharded over "
               "the stage's tp x dp-shard ranks, routed experts over ep x dp-shard; saved activations: the peak "
               "micro-batches in flight times one micro-batch's, which the stage's trace will report):")
    costs = spec.model_spec.stage_costs(spec.cfg, spec.seq_len)

    def state_bytes(s: int) -> float:
        """Stage s's parameter state per rank."""
        (a, b), last = record.stage_layers[s], s == record.n_stages - 1
        experts = costs.stage_expert_params(a, b)
        dense = costs.stage_params(a, b, first=s == 0, last=last) - experts
        return (dense / (layout.tp * layout.dp_shard) + experts / (layout.ep * layout.dp_shard)) * PARAM_STATE_BYTES

    for s, (a, b) in enumerate(record.stage_layers):
        params = costs.stage_params(a, b, first=s == 0, last=s == record.n_stages - 1)
        click.echo(f"  stage {s}: {params / 1e9:.3g} B parameters, {state_bytes(s) / GIB:.2f} GiB per rank; "
                   f"{record.in_flight(s)} micro-batches in flight")
    if record.n_stages > layout.pp:  # several stages per rank: what each rank holds of them together
        for r in range(layout.pp):
            stages = [s for s in range(record.n_stages) if record.stage_rank[s] == r]
            click.echo(f"  pp rank {r} (stages {', '.join(map(str, stages))}): "
                       f"{sum(map(state_bytes, stages)) / GIB:.2f} GiB per rank; at most "
                       f"{record.rank_in_flight(r)} stage micro-batches in flight")

"""train_bench.py's `eager` row on a pipeline layout: titan's own model code, this rank's stages
run by torch.distributed.pipelining (PipelineStage and the schedule's torch class), exactly as
titan-verify's eager reference runs them (cli/tools/eager_pipeline.py), so that the titan rows
have their numerics reference beside them (titan's default mode is bitwise equal to it).
Precision as the other eager rows: bf16 compute (the stages parallelized with titan's
compute dtype), fp32 parameters and AdamW state. torch.optim.AdamW defaults; with --max-norm,
torchtitan's clipping across the stages.
"""

from __future__ import annotations

import os


def eager_pipeline_worker(mode: str, flavor: str, layout_name: str, batch: int, seq_len: int, steps: int, out: str,
                          *, max_norm: float, microbatches: int) -> None:
    import torch

    from titan.builder.models import model_spec
    from titan.builder.spec.pipeline_order import pipeline_schedule
    from titan.cli.tools.eager_pipeline import EagerPipeline
    from titan.runtime.contract.layout import Layout
    from titan.runtime.data import SyntheticTokens

    from bench_pipeline import bench_pipeline
    from bench_worker import StepRecord, global_loss, join_ranks, leave
    from profile_steps import step_profiler_from_env
    from train_bench import LAYOUTS

    if mode != "eager":
        raise SystemExit(f"error: {mode} does not run pipeline layouts (eager does: titan's model under "
                         "torch.distributed.pipelining; ref-compile and tt-compile are the compiled peers)")
    rank, device = join_ranks()
    on_gpu = device.type == "cuda"  # CPU (gloo) only to check this script
    spec = model_spec("llama3")
    cfg = spec.flavors[flavor]
    layout = Layout(**LAYOUTS[layout_name])
    pipeline = bench_pipeline(layout_name, flavor=flavor, seq_len=seq_len, microbatches=microbatches)
    schedule = pipeline_schedule(pipeline.schedule, spans=tuple(pipeline.spans()), microbatches=microbatches,
                                 stages_per_rank=pipeline.stages_per_rank)
    mesh = layout.build_mesh(device.type)
    coords = layout.coordinates(rank)
    compute = torch.bfloat16 if on_gpu else torch.float32
    eager = EagerPipeline(spec, cfg, layout, rank, batch_size=batch, seq_len=seq_len, device=device, mesh=mesh,
                          seed=0, compute_dtype=compute, schedule=schedule)
    opt = torch.optim.AdamW(eager.params, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=batch, seq_len=seq_len, seed=0,
                           dp_rank=layout.dp_rank(coords))
    record = StepRecord(device)
    on_step = step_profiler_from_env(f"{layout_name}-{mode}", steps, rank)
    for step in range(steps):
        # The micro-batches titan-run reads for this step (runtime/train_loop.py).
        batches = [tuple(t.to(device) for t in data.batch(step * microbatches + k)) for k in range(microbatches)]
        record.start()
        loss = eager.step(batches)
        eager.clip_grad_norm(max_norm if max_norm > 0 else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.stop(global_loss(loss, layout, mesh).item())
        if on_step is not None:
            on_step(step + 1)
    leave(record, rank, out)

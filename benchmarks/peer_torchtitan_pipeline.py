"""torchtitan's pipeline for the tt rows of train_bench.py's pipeline layouts (peer_torchtitan.py):
its job settings, and the check of its stages on a host without CUDA."""

from __future__ import annotations

import torch


def set_pipeline(c, pipeline, *, batch: int) -> None:
    """torchtitan's pipeline settings on JobConfig `c` for `pipeline` (a bench_pipeline.BenchPipeline):
    the schedule by torch's name, a local batch of the step's micro-batches cut into micro-batches
    of `batch` sequences, and titan's stage split as module names per stage (torchtitan's own
    default weighs the embedding and the output as one block each)."""
    c.training.local_batch_size = batch * pipeline.microbatches
    c.parallelism.pipeline_parallel_degree = pipeline.pp
    c.parallelism.pipeline_parallel_schedule = pipeline.torch_schedule
    c.parallelism.pipeline_parallel_microbatch_size = batch
    c.parallelism.module_fqns_per_model_part = pipeline.module_fqns()


def stages_without_gpu(spec, config, model, pipeline) -> str:
    """torchtitan's own pipelining_fn on the meta model, over a gloo mesh of the job's
    ParallelDims (torchtitan's device type set to the CPU for this check alone): its split into
    this rank's PipelineStages, parallelize_llama (and the one-rank FSDP2 policy) on each, and the
    schedule; says which stages, blocks and precision this rank got, checked against titan's split."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims

    dist.init_process_group("gloo")
    parallel_dims_module.device_type = "cpu"
    p = config.parallelism
    dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=1, cp=1, tp=p.tensor_parallel_degree,
                        pp=p.pipeline_parallel_degree, ep=1, etp=1, world_size=dist.get_world_size())
    args = spec.model_args[config.model.flavor]
    schedule, parts, _, _ = spec.pipelining_fn(model, dims, config, torch.device("cpu"), args, spec.parallelize_fn,
                                               spec.build_loss_fn(config))
    pp_rank = dims.get_mesh("pp").get_local_rank()
    stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    held = [stage.stage_index for stage in stages]
    if held != pipeline.stages_of(pp_rank):
        raise SystemExit(f"error: torchtitan placed stages {held} on pp rank {pp_rank}; titan places "
                         f"{pipeline.stages_of(pp_rank)}")
    for index, part in zip(held, parts):
        blocks = [int(k) for k in part.layers.keys()]
        if (blocks[0], blocks[-1] + 1) != pipeline.spans()[index]:
            raise SystemExit(f"error: torchtitan's stage {index} holds blocks {blocks}; titan's holds "
                             f"{pipeline.spans()[index]}")
    blocks = [b for part in parts for b in part.layers.values()]
    policies = {str(b._get_fsdp_state()._mp_policy.param_dtype) if isinstance(b, FSDPModule) else "no FSDP"
                for b in blocks}
    dist.destroy_process_group()
    return (f"pp rank {pp_rank}: torchtitan's {type(schedule).__name__} over {schedule._n_microbatches} "
            f"micro-batches, stages {held} holding " + ", ".join(
                f"blocks {a}-{b - 1} ({sum(p.numel() for p in part.parameters()):,} parameters)"
                for part, (a, b) in zip(parts, (pipeline.spans()[i] for i in held)))
            + f", as titan splits them; blocks' FSDP2 parameter dtype {', '.join(sorted(policies))}")

"""The plain-PyTorch reference rows (peer_ref.py) on a pipeline layout: its Llama 3, cut into
this rank's stages and run by torch.distributed.pipelining, as a user writes it without a
framework.

Each stage is an `LlamaStage`: blocks [start, stop) of peer_ref's Llama (titan's split,
bench_pipeline.py), the first with the embedding, the last with the norm and output. On each
stage, as peer_ref.py does it for the whole model: DTensor TP with sequence parallel (the plan's
entries for the modules the stage holds), FSDP2 `fully_shard` per block and at the stage's root
over the data-parallel mesh (one rank without data-parallel shards: the precision policy alone)
with `MixedPrecisionPolicy(bf16, fp32)` and no reshard after forward (as torchtitan sets it under
PP: no all-gather per micro-batch); ref-compile compiles each block first. Then a PipelineStage
per stage and the layout's schedule class (`get_schedule_class`) over --microbatches
micro-batches, the loss the summed token loss over each micro-batch's global tokens and the
schedule's own gradient scaling (the mean over micro-batches, titan's loss); fused AdamW; with
--max-norm, the gradient norm across the stages (each stage's DTensor norm, its square summed
over the pipeline), as torchtitan clips under PP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from peer_ref import Block, Linear, Llama, tp_plan


class LlamaStage(nn.Module):
    def __init__(self, cfg, start: int, stop: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if first else None
        # Keyed by the model's block index, so the TP plan's `layers.*` entries apply as they do to Llama.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(start, stop)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps) if last else None
        self.output = Linear(cfg.dim, cfg.vocab_size) if last else None

    init_weights = Llama.init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h, self.cos, self.sin)
        return self.output(self.norm(h)) if self.output is not None else h


def build_stages(mode: str, cfg, pipeline, mesh, seq_len: int, device: torch.device) -> dict[int, LlamaStage]:
    """This rank's stages, parallelized and initialized."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    pp_rank, last = mesh["pp"].get_local_rank(), pipeline.n_stages - 1
    stages = {}
    torch.manual_seed(0)
    for s in pipeline.stages_of(pp_rank):
        with torch.device("meta"):
            stage = LlamaStage(cfg, *pipeline.spans()[s], first=s == 0, last=s == last)
        if mesh["tp"].size() > 1:
            held = {"tok_embeddings": s == 0, "norm": s == last, "output": s == last}
            parallelize_module(stage, mesh["tp"], {k: v for k, v in tp_plan().items() if held.get(k, True)})
        if mode == "ref-compile":
            for block in stage.layers.values():
                block.compile(fullgraph=True)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in stage.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"], mp_policy=mp, reshard_after_forward=False)
        fully_shard(stage, mesh=mesh["dp_shard"], mp_policy=mp, reshard_after_forward=False)
        stage.to_empty(device=device)
        with torch.no_grad():
            stage.init_weights(seq_len, device)
        stages[s] = stage
    return stages


def clip_across_stages(params: list[torch.Tensor], max_norm: float, pp_group) -> None:
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    square = norm ** 2
    dist.all_reduce(square, group=pp_group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, square ** 0.5)


def run_pipeline(mode: str, cfg, pipeline, *, batch: int, seq_len: int, steps: int, dp_shard: int, tp: int,
                 device: torch.device, max_norm: float, record, on_step) -> None:
    """Train `steps` steps of this rank's stages; rank 0's times and losses go to `record`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torch.distributed.tensor.parallel import loss_parallel

    from titan.runtime.data import SyntheticTokens

    mesh = init_device_mesh(device.type, (pipeline.pp, dp_shard, tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    stages = build_stages(mode, cfg, pipeline, mesh, seq_len, device)
    pp_group = mesh["pp"].get_group()
    torch_stages = [PipelineStage(stage, s, pipeline.n_stages, device, group=pp_group) for s, stage in stages.items()]
    tokens_per_microbatch = float(batch * seq_len * dp_shard)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens_per_microbatch

    schedule_class = get_schedule_class(pipeline.torch_schedule)
    single = issubclass(schedule_class, PipelineScheduleSingle)
    schedule = schedule_class(torch_stages[0] if single else torch_stages, n_microbatches=pipeline.microbatches,
                              loss_fn=loss_fn)
    first, last = 0 in stages, pipeline.n_stages - 1 in stages
    params = [p for stage in stages.values() for p in stage.parameters()]
    opt = torch.optim.AdamW(params, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=batch, seq_len=seq_len, seed=0,
                           dp_rank=mesh["dp_shard"].get_local_rank())
    for step in range(steps):
        parts = [data.batch(step * pipeline.microbatches + k) for k in range(pipeline.microbatches)]
        tokens, labels = (torch.cat(t).to(device) for t in zip(*parts))
        record.start()
        losses: list[torch.Tensor] = []
        target = {"target": labels, "losses": losses} if last else {}
        with loss_parallel() if tp > 1 else torch.enable_grad():
            schedule.step(*((tokens,) if first else ()), **target)
        if max_norm > 0:
            clip_across_stages(params, max_norm, pp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        reported = torch.zeros((), device=device)
        for loss in losses:  # the mean over micro-batches, on the last stage; zero elsewhere
            loss = loss.detach()
            reported += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss) / len(losses)
        dist.all_reduce(reported, group=pp_group)
        if dp_shard > 1:  # the mean loss over the global batch
            dist.all_reduce(reported, group=mesh["dp_shard"].get_group())
        record.stop(reported.item())
        if on_step is not None:
            on_step(step + 1)

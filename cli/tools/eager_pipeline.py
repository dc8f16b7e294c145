"""Eager PyTorch reference of a pipeline artifact: this rank's stages of the same model code
(builder/models/decoder_stage.py), parallelized over tp, dp-shard and ep as the build's trace does
(a MoE's dispatch over each stage's own ranks),
run by PyTorch's own torch.distributed.pipelining (PipelineStage and the schedule class the
artifact names), with autograd's backward, the schedule's own gradient scaling and torchtitan's
clipping across stages. titan-verify compares a pipeline artifact against this.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from titan.builder.models.decoder import ScaledTokenLoss
from titan.builder.models.decoder_stage import DecoderStage
from titan.builder.models.spec import ModelConfig, ModelSpec, RankPlace
from titan.builder.trace.parallelize import parallelize
from titan.cli.tools.eager import _placement, materialize_shards
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.pipeline_schedule import PipelineSchedule
from titan.runtime.pipeline_program import pipeline_loss

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
                    "zbv": ScheduleZBVZeroBubble}
"""torch's class of each schedule titan builds."""
SINGLE_STAGE = (ScheduleGPipe, Schedule1F1B)
"""The classes that take one stage per rank (the others take the rank's list of stages)."""


class EagerPipeline:
    def __init__(self, spec: ModelSpec, cfg: ModelConfig, layout: Layout, rank: int, *, batch_size: int,
                 seq_len: int, device: torch.device, mesh, seed: int, compute_dtype: torch.dtype,
                 schedule: PipelineSchedule, capacity_factor: float | None = None):
        """`capacity_factor`: a MoE dispatch that drops past this capacity (the reference of a
        drop-and-pad artifact); None: dropless."""
        with torch.device("meta"):
            model = spec.build(cfg)
        model.loss_scale = float(batch_size * seq_len * layout.dp_degree)
        coords = layout.coordinates(rank)
        shards = parallelize(model, layout, mesh, coords, tp_plan=spec.tp_plan, expert_param=spec.expert_param,
                             compute_dtype=compute_dtype)
        others = tuple(d for d in mesh.mesh_dim_names if d != "pp")
        self.stage_mesh = mesh[others] if others else None
        # A stage routes over its own ranks, as its trace does: the layout and mesh without pp
        # (each stage's MoE blocks sum their own expert load).
        spec.place_rank(model, RankPlace(layout=replace(layout, pp=1), mesh=self.stage_mesh, batch_size=batch_size,
                                         seq_len=seq_len, capacity_factor=capacity_factor))
        n = schedule.n_stages
        held = [s for s in range(n) if schedule.stage_rank[s] == coords["pp"]]
        loss = ScaledTokenLoss(model.loss_scale)
        self.stages = {s: DecoderStage(model, *schedule.stage_layers[s], first=s == 0, last=s == n - 1,
                                       seq_len=seq_len, loss_fn=loss) for s in held}
        for module in self.stages.values():  # only this rank's stages get real weights
            materialize_shards(module, shards, spec.init_specs(cfg), seed=seed, device=device)
        self.named_params = [(fqn, p) for s in held for fqn, p in self.stages[s].named_parameters()]
        self.named_buffers = [(fqn, b) for s in held for fqn, b in self.stages[s].named_buffers()]
        self.params = [p for _, p in self.named_params]
        placements = {shard.fqn: shard.placements for shard in shards}
        self.placements = [placements[fqn] for fqn, _ in self.named_params]
        self.first, self.last = 0 in held, n - 1 in held
        self.reads_tokens = any(stage.reads_tokens for stage in self.stages.values())
        self.device, self.group = device, mesh.get_group("pp")
        torch_stages = [PipelineStage(self.stages[s], s, n, device, group=self.group) for s in held]
        for stage in torch_stages:
            _keep_buffers_through_shape_inference(stage)
        schedule_class = SCHEDULE_CLASSES[schedule.schedule]
        stages_arg = torch_stages[0] if schedule_class in SINGLE_STAGE else torch_stages
        self.schedule = schedule_class(stages_arg, n_microbatches=schedule.microbatches, loss_fn=loss)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One step of the step's micro-batches, as torch's schedule runs it (it splits the
        concatenated batch back into the same micro-batches and scales the gradients by their
        count); the step's loss on every pp rank (runtime/pipeline_program.py's pipeline_loss)."""
        tokens = torch.cat([t for t, _ in batches])
        labels = torch.cat([lb for _, lb in batches])
        losses: list[torch.Tensor] = []
        keywords = {"target": labels, "losses": losses} if self.last else {}
        # Under the document mask every stage reads the micro-batch's tokens (DecoderStage's
        # `tokens`): the schedule splits keyword inputs into micro-batches and gives each stage its own.
        if self.reads_tokens:
            keywords["tokens"] = tokens
        if self.first:
            self.schedule.step(tokens, **keywords)
        else:
            self.schedule.step(**keywords)
        return pipeline_loss(losses if self.last else None, device=self.device, group=self.group)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """torchtitan's clipping with pipeline stages: the norm of this stage's gradients as
        DTensors on the stage's mesh (torch.nn.utils.get_total_norm), its square summed over the
        pipeline, the root, then clip_grads_with_norm_."""
        grads = [p.grad for p in self.params]
        if self.stage_mesh is not None:
            names = self.stage_mesh.mesh_dim_names
            grads = [DTensor.from_local(g, self.stage_mesh, [_placement(pl.get(d, "R")) for d in names],
                                        run_check=False) for g, pl in zip(grads, self.placements)]
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norm = norm ** 2.0
        torch.distributed.all_reduce(norm, group=self.group)
        norm = norm ** (1.0 / 2.0)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)
        return norm


def _keep_buffers_through_shape_inference(stage: PipelineStage) -> None:
    """torch's PipelineStage learns the shapes it sends by running its module once, on
    placeholder tensors, before the first micro-batch (its forward metadata inference). A MoE
    block's forward updates its buffers in place (the balancing bias, the expert load), so that
    run would count as a step of routing: the buffers are put back after it."""
    assert hasattr(stage, "_prepare_forward_infra"), "this torch's PipelineStage infers shapes another way"
    infer, module = stage._prepare_forward_infra, stage.submod

    def prepare_forward_infra(*args, **kwargs):
        kept = [b.clone() for b in module.buffers()]
        try:
            return infer(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in zip(module.buffers(), kept):
                    buffer.copy_(value)

    stage._prepare_forward_infra = prepare_forward_infra

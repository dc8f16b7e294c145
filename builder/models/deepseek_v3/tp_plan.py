"""DeepSeek-V3's tensor-parallel plan (with sequence parallel).

Like Llama's where the shapes are Llama's: a vocab-parallel embedding, sequence-parallel norms,
the dense feed-forward blocks column- then row-parallel, the output projection column-parallel.
Multi-head latent attention splits its heads: the up-projections out of the latents (`wq_b`,
`wkv_b`, or `wq` without a query latent) are column-parallel, `wo` row-parallel. The
down-projections into the latents and their norms (`wq_a`, `q_norm`, `wkv_a`, `kv_norm`) see
the whole sequence on every rank and stay replicated: their gradients are complete on every
rank. The rotary key part shared by all heads meets only this rank's heads, so its gradient is
summed over tp (`rope_key`).

The mixture of experts routes this rank's sequence shard (builder/models/decoder_tp.py's
routed_experts_plan), or with --etp the whole sequence, each routed expert split over tp.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from titan.builder.models.decoder_tp import embedding_and_output_plan, routed_experts_plan, swiglu_plan
from titan.builder.models.deepseek_v3.model import DeepSeekV3


class ReplicateParallel(ParallelStyle):
    """A module whose input is the same on every tp rank: parameters replicated, local tensors
    in and out; nothing is reduced (each rank computes the complete gradient)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            input_fn=lambda _m, inputs, mesh: tuple(DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
                                                    for t in inputs),
            output_fn=lambda _m, out, _mesh: out.to_local())


class SumGradients(ParallelStyle):
    """An identity module whose input's gradient is summed over tp (each rank's share of it)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            input_fn=lambda _m, inputs, mesh: tuple(
                DTensor.from_local(t, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
                for t in inputs))


def tp_plan(model: DeepSeekV3) -> dict:
    cfg = model.cfg
    plan = embedding_and_output_plan()
    for name, block in model.layers.items():
        p = f"layers.{name}."
        plan.update({
            p + "attention_norm": SequenceParallel(),
            p + "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None),
                                                use_local_output=True),
            p + "attention.wkv_a": ReplicateParallel(),
            p + "attention.kv_norm": ReplicateParallel(),
            p + "attention.wkv_b": ColwiseParallel(),
            p + "attention.rope_key": SumGradients(),
            p + "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            p + "ffn_norm": SequenceParallel(),
        })
        if cfg.q_lora_rank:
            plan.update({p + "attention.wq_a": ReplicateParallel(), p + "attention.q_norm": ReplicateParallel(),
                         p + "attention.wq_b": ColwiseParallel()})
        else:
            plan[p + "attention.wq"] = ColwiseParallel()
        plan.update(routed_experts_plan(p, expert_tp=cfg.etp > 1) if block.moe else swiglu_plan(p))
    return plan

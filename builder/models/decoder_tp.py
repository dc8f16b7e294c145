"""The tensor-parallel plan pieces (with sequence parallel) that the decoder families share, as
torchtitan's: a vocab-parallel embedding, sequence-parallel norms, column- then row-parallel
projections around attention and the SwiGLU feed-forward, and a column-parallel output
projection whose logits are gathered for the loss. Each returns plan entries (module path ->
parallel style) for parallelize_module; a family's tp_plan puts them together."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


def embedding_and_output_plan() -> dict:
    """The vocab-parallel embedding (its output sequence-sharded), the final norm and the output
    projection (vocab-sharded weight, logits gathered whole). Both weights are split on dim 0
    (the vocabulary), so a tied embedding is split alike in both places."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    }


def gqa_attention_plan(prefix: str) -> dict:
    """A block's norms (sequence parallel) and grouped-query attention: heads split over tp.
    Modules inside attention that the plan leaves out (Qwen3's per-head q/k norms) see this
    rank's heads as local tensors; their parameters' gradients are summed over tp."""
    return {
        prefix + "attention_norm": SequenceParallel(),
        prefix + "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
        prefix + "attention.wq": ColwiseParallel(),
        prefix + "attention.wk": ColwiseParallel(),
        prefix + "attention.wv": ColwiseParallel(),
        prefix + "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        prefix + "ffn_norm": SequenceParallel(),
    }


def swiglu_plan(prefix: str) -> dict:
    """A dense SwiGLU feed-forward: hidden width split over tp."""
    return {
        prefix + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        prefix + "feed_forward.w1": ColwiseParallel(),
        prefix + "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        prefix + "feed_forward.w3": ColwiseParallel(),
    }


def routed_experts_plan(prefix: str, *, expert_tp: bool = False) -> dict:
    """A mixture of experts routes this rank's sequence shard, as torchtitan's does with sequence
    parallel: this rank's tokens in, this rank's tokens out (local tensors). Its parameters,
    which the plan leaves plain, have their gradients summed over tp (builder/trace/parallelize.py).
    With `expert_tp` (--etp = --tp) the routed experts' hidden width is split over tp instead
    (builder/models/moe/expert_tp.py: the layer gathers its tokens and reduce-scatters its output)."""
    if expert_tp:
        from titan.builder.models.moe.expert_tp import ExpertTensorParallel as style
    else:
        style = PrepareModuleInput
    return {prefix + "feed_forward": style(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True)}


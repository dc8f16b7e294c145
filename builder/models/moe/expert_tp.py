"""Expert tensor parallelism (`titan-build --etp N`, N = --tp): each routed expert's hidden
width split over the tensor-parallel ranks, as a dense SwiGLU's is, instead of every tp rank
holding its ep rank's experts whole.

As torchtitan's ExpertTensorParallel: the tp ranks of a MoE layer see the same tokens (the
sequence shards gathered), route them alike, dispatch them over `ep` at their own tp
coordinate, and run their slice of every expert: `w1`/`w3` split on the hidden rows (dim 1),
`w2` on the hidden columns (dim 2). SwiGLU's product is element-wise in the hidden width, so
each rank's hidden slice is exactly the slice of the whole; `w2` then gives a partial sum over
tp, and the combined output is reduce-scattered back to each rank's sequence shard.

The gradients follow from the two collectives' autograd: the reduce-scatter's backward
all-gathers the output's gradient, so every tp rank back-propagates the whole gradient through
its slice; what reaches the gathered tokens (through the experts and through the routing
weights) is each slice's share, and the all-gather's backward sums it over tp and hands each
rank its shard. The router's weight is replicated and sees the same tokens on every tp rank,
with each rank's share of its gradient: summed over tp, like every parameter the tp plan leaves
plain (builder/trace/parallelize.py). The expert slices' gradients are complete on each rank.

The shared experts (DeepSeek-V3) stay as without expert TP: on this rank's sequence shard,
weights replicated over tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput

from titan.builder.models.moe import EXPERT_WEIGHTS

# torch 2.13 renamed the two autograd collectives (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd

HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1}
"""Where each stacked expert weight ((experts, out, in)) holds the hidden width."""


class ExpertTensorParallel(PrepareModuleInput):
    """A MoE layer's input as without expert TP (PrepareModuleInput: this rank's sequence shard,
    a local tensor), and its stacked expert weights split on their hidden width over the tp mesh.
    The layer itself gathers its tokens and reduce-scatters its output (gather_sequence,
    sum_sequence_shards)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in EXPERT_WEIGHTS:
            hidden = Shard(HIDDEN_DIM[name])
            module.register_parameter(name, nn.Parameter(distribute_tensor(getattr(module, name), device_mesh, [hidden])))
        return super()._apply(module, device_mesh)


def local_experts(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's expert weights as this rank's local tensors (its hidden slice under expert TP:
    no collective either way, the gradient is the slice's own)."""
    weights = {name: getattr(layer, name) for name in EXPERT_WEIGHTS}
    return {name: w.to_local() if isinstance(w, DTensor) else w for name, w in weights.items()}


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(batch, seq / tp, dim) -> (batch, seq, dim), the same on every tp rank; its backward sums
    the ranks' gradients and keeps this rank's shard. Identity without expert TP."""
    if group is None:
        return x
    return _all_gather(x.contiguous(), 1, group)


def sum_sequence_shards(partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(batch, seq, dim) partial sums over tp -> this rank's (batch, seq / tp, dim) of their
    sum; its backward gathers the gradient. Identity without expert TP."""
    if group is None:
        return partial
    return _reduce_scatter(partial.contiguous(), "sum", 1, group)

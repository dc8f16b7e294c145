"""Qwen3's mixture of experts: a softmax router over all experts, the top_k chosen, their
probabilities renormalized (norm_topk_prob), routed SwiGLU experts dispatched over
expert-parallel ranks (builder/models/moe/dispatch.py). No shared experts and no balancing
bias; transformers adds a load-balancing auxiliary loss only when asked for router logits
(output_router_logits), which its training default and titan leave off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan.builder.models.moe.load import global_load
from titan.builder.models.qwen3.config import Qwen3Config
from titan.builder.models.moe.layer import add_dispatch_state, add_router_and_experts, run_routed_experts


def route(x: torch.Tensor, gate_weight: torch.Tensor, *, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, routing weights), each (tokens, top_k), for x: (tokens, dim), as
    transformers' Qwen3MoeTopKRouter: logits in the compute dtype, softmax in fp32."""
    probs = F.softmax(F.linear(x, gate_weight), dim=-1, dtype=torch.float32)
    weights, expert_ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return expert_ids, weights.to(x.dtype)


class MoE(nn.Module):
    """Routed experts (this rank's share under expert parallelism).

    `plan`, `ep_group` and `load_groups` are set by builder/models/moe/expert_parallel.py before
    the first forward. Buffers written by each forward (read after the step, never inside it):
    `tokens_per_expert` (global load of the step) and `dropped_tokens` (assignments dropped for
    capacity, global), titan-run's expert-load metrics.
    """

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        e, d, h = cfg.n_experts, cfg.dim, cfg.moe_hidden
        self.n_experts, self.top_k, self.norm_topk_prob = e, cfg.top_k, cfg.norm_topk_prob
        add_router_and_experts(self, experts=e, dim=d, hidden=h)
        add_dispatch_state(self, experts=e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, routed = run_routed_experts(self, x, lambda flat: route(flat, self.gate.weight, top_k=self.top_k,
                                                                     norm_topk_prob=self.norm_topk_prob))
        self._record_load(routed.tokens_per_expert, routed.dropped)
        return out

    @torch.no_grad()
    def _record_load(self, tokens_per_expert: torch.Tensor, dropped: torch.Tensor) -> None:
        load, dropped = global_load(tokens_per_expert, dropped, self.load_groups)
        self.tokens_per_expert.copy_(load)
        self.dropped_tokens.copy_(dropped)

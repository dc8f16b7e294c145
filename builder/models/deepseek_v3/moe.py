"""DeepSeek-V3's mixture of experts: sigmoid router with group-limited top-k and the
auxiliary-loss-free balancing bias, routed SwiGLU experts (dispatched over expert-parallel
ranks, see builder/models/moe/dispatch.py) and shared experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan.builder.models.decoder import SwiGLU
from titan.builder.models.deepseek_v3.config import DeepSeekV3Config
from titan.builder.models.moe.load import global_load
from titan.builder.models.moe.layer import add_dispatch_state, add_router_and_experts, run_routed_experts


def route(x: torch.Tensor, gate_weight: torch.Tensor, expert_bias: torch.Tensor, cfg: DeepSeekV3Config
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, routing weights), each (tokens, top_k), for x: (tokens, dim).

    The bias only steers the choice; the weights are the unbiased sigmoid scores of the chosen
    experts, normalized over them and scaled by route_scale.
    """
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()
    biased = scores + expert_bias
    if cfg.n_limited_groups < cfg.n_expert_groups:
        # A group's score is the sum of its two best experts; experts outside the best groups
        # cannot be chosen.
        grouped = biased.unflatten(-1, (cfg.n_expert_groups, -1))
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(cfg.n_limited_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)
        biased = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
    expert_ids = biased.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg.route_scale
    return expert_ids, weights


class MoE(nn.Module):
    """Routed experts (this rank's share under expert parallelism) plus shared experts.

    `plan` and `ep_group` are set by whoever lays the model out (the builder, the eager
    reference, a test) before the first forward: the dispatch needs the static token count.
    `load_groups` add up every rank that routes its own tokens and shares the balancing bias:
    their expert loads are summed so that every replica applies the same update.

    Buffers written by each forward (read after the step, never inside it):
    `expert_bias` (the balancing bias, updated from this step's load), `tokens_per_expert`
    (global load of the step) and `dropped_tokens` (assignments dropped for capacity, global).
    """

    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__()
        self.cfg = cfg
        e, d, h = cfg.n_routed_experts, cfg.dim, cfg.moe_hidden
        self.n_experts, self.top_k = e, cfg.top_k
        add_router_and_experts(self, experts=e, dim=d, hidden=h)
        self.shared_experts = SwiGLU(d, h * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        add_dispatch_state(self, experts=e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, routed = run_routed_experts(self, x, lambda flat: route(flat, self.gate.weight, self.expert_bias,
                                                                     self.cfg))
        self._record_load(routed.tokens_per_expert, routed.dropped)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @torch.no_grad()
    def _record_load(self, tokens_per_expert: torch.Tensor, dropped: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): after routing with the
        current bias, move every expert's bias by bias_update_rate towards the mean load."""
        load, dropped = global_load(tokens_per_expert, dropped, self.load_groups)
        load_f = load.float()
        self.expert_bias.add_(torch.sign(load_f.mean() - load_f) * self.cfg.bias_update_rate)
        self.tokens_per_expert.copy_(load)
        self.dropped_tokens.copy_(dropped)

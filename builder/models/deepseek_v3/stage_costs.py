"""DeepSeek-V3's pipeline stage costs (builder/spec/stage_split.py): dense blocks first, then MoE
blocks, each costing what a token runs through it. No torch import."""

from __future__ import annotations

from titan.builder.models.deepseek_v3.config import DeepSeekV3Config
from titan.builder.spec.stage_split import StageCosts


def stage_costs(cfg: DeepSeekV3Config, seq_len: int) -> StageCosts:
    """Training FLOPs per token: 6 per parameter a token passes through (a MoE block's attention,
    router, shared experts and its top_k routed experts, not all of them) plus attention's
    6 x sequence x heads x (query/key + value head dims); the embedding's lookup and the output's
    6 x width x vocabulary, as for a dense decoder. Parameters: every routed expert counted,
    and apart, for the memory each rank holds."""
    attention_flops = 6 * seq_len * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    blocks = [layer >= cfg.n_dense_layers for layer in range(cfg.n_layers)]
    active = [cfg.attention_params + cfg.feed_forward_params(moe=moe, experts=cfg.top_k) for moe in blocks]
    routed = 3 * cfg.dim * cfg.moe_hidden * cfg.n_routed_experts
    embedding, head = cfg.vocab_size * cfg.dim, cfg.vocab_size * cfg.dim + cfg.dim
    return StageCosts(block=tuple(6 * n + attention_flops for n in active), embedding=2 * cfg.dim,
                      head=6 * cfg.vocab_size * cfg.dim,
                      block_params=tuple(cfg.attention_params + cfg.feed_forward_params(moe=moe) for moe in blocks),
                      embedding_params=embedding, head_params=head,
                      block_expert_params=tuple(routed if moe else 0 for moe in blocks))

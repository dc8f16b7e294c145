"""DeepSeek-V3's pipeline stage costs (builder/spec/stage_split.py): dense blocks first, then MoE
blocks, each costing what a token runs through it. No torch import."""

from __future__ import annotations

from titan.builder.models.deepseek_v3.config import DeepSeekV3Config
from titan.builder.spec.stage_split import StageCosts, decoder_costs


def stage_costs(cfg: DeepSeekV3Config, seq_len: int) -> StageCosts:
    """A MoE block costs its attention, router, shared experts and top_k routed experts (not all
    of them); attention's width is the heads' query/key plus value dims (MLA's own sizes)."""
    routed = 3 * cfg.dim * cfg.moe_hidden * cfg.n_routed_experts
    blocks = [(cfg.attention_params + cfg.feed_forward_params(moe=moe),
               cfg.attention_params + cfg.feed_forward_params(moe=moe, experts=cfg.top_k), routed if moe else 0)
              for moe in (layer >= cfg.n_dense_layers for layer in range(cfg.n_layers))]
    return decoder_costs(dim=cfg.dim, vocab_size=cfg.vocab_size, seq_len=seq_len,
                         attention_width=cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim), blocks=blocks)

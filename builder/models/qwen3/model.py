"""Qwen3 decoder, dense or with a mixture of experts, written for tracing: Llama's block
(builder/models/decoder.py) with a per-head RMSNorm of queries and keys before RoPE, an
explicit head width, and, in the small dense models, the output projection tied to the
embedding (one parameter: builder/trace/parallelize.py keeps it one under every layout).
"""

from __future__ import annotations

import torch
from torch import nn

from titan.builder.models.decoder import Decoder, DecoderBlock, GroupedQueryAttention, SwiGLU, decoder_loss
from titan.builder.models.qwen3.config import Qwen3Config
from titan.builder.models.qwen3.moe import MoE


def transformer_block(cfg: Qwen3Config, layer: int) -> DecoderBlock:
    attention = GroupedQueryAttention(dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                      head_dim=cfg.head_dim, qk_norm_eps=cfg.norm_eps,
                                      attention=cfg.attention)
    moe = cfg.is_moe_layer(layer)
    return DecoderBlock(dim=cfg.dim, norm_eps=cfg.norm_eps, attention=attention,
                        feed_forward=MoE(cfg) if moe else SwiGLU(cfg.dim, cfg.ffn_hidden), moe=moe)


class Qwen3(Decoder):
    """Qwen3 (builder/models/decoder.py's Decoder says what its forward returns); the small dense
    flavors' output projection is the embedding (one parameter)."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__(cfg, [transformer_block(cfg, i) for i in range(cfg.n_layers)])
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1], tokens.device)
        return decoder_loss(self, tokens, labels, cos, sin)

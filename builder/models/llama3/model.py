"""Llama 3 decoder (GQA, RoPE, SwiGLU, RMSNorm), written for tracing: the pieces are
builder/models/decoder.py's.

The model is plain PyTorch: the builder parallelizes it with DTensor and traces it, and
titan-verify runs the very same code eagerly as the reference.
"""

from __future__ import annotations

import torch

from titan.builder.models.decoder import Decoder, DecoderBlock, GroupedQueryAttention, SwiGLU, decoder_loss
from titan.builder.models.llama3.config import LlamaConfig


def transformer_block(cfg: LlamaConfig) -> DecoderBlock:
    attention = GroupedQueryAttention(dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                      attention=cfg.attention)
    return DecoderBlock(dim=cfg.dim, norm_eps=cfg.norm_eps, attention=attention,
                        feed_forward=SwiGLU(cfg.dim, cfg.ffn_hidden))


class Llama3(Decoder):
    """Llama 3 (builder/models/decoder.py's Decoder says what its forward returns)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, [transformer_block(cfg) for _ in range(cfg.n_layers)])

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1], tokens.device)
        return decoder_loss(self, tokens, labels, cos, sin)

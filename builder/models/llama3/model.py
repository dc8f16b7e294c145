"""Llama 3 decoder (GQA, RoPE, SwiGLU, RMSNorm), written for tracing: the pieces are
builder/models/decoder.py's.

The model is plain PyTorch: the builder parallelizes it with DTensor and traces it, and
titan-verify runs the very same code eagerly as the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from titan.builder.models.decoder import DecoderBlock, GroupedQueryAttention, RMSNorm, SwiGLU, decoder_loss, rope_tables
from titan.builder.models.llama3.config import LlamaConfig


def transformer_block(cfg: LlamaConfig) -> DecoderBlock:
    attention = GroupedQueryAttention(dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
    return DecoderBlock(dim=cfg.dim, norm_eps=cfg.norm_eps, attention=attention,
                        feed_forward=SwiGLU(cfg.dim, cfg.ffn_hidden))


class Llama3(nn.Module):
    """Decoder that returns this rank's share of the mean next-token loss.

    `loss_scale` (an attribute) divides the summed token loss: the builder sets it to the number of tokens
    in the global batch, so summing every data-parallel rank's output gives the mean loss
    and the gradients (summed by the data-parallel reductions) are those of that mean.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): transformer_block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    loss_scale: float = 1.0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        return decoder_loss(self, tokens, labels, cos, sin)

"""Llama 3 decoder (GQA, RoPE, SwiGLU, RMSNorm), written for tracing.

The model is plain PyTorch (attention goes through the runtime's device-dispatched op): the builder parallelizes it with DTensor and traces it, and
titan-verify runs the very same code eagerly as the reference. RoPE tables are computed
inside forward (not stored as buffers), so a traced graph needs no constants.
"""

from __future__ import annotations

import torch
from torch import nn

from titan.builder.models.decoder import RMSNorm, SwiGLU, apply_rope, decoder_loss
from titan.builder.models.llama3.config import LlamaConfig
from titan.runtime.contract.ops import causal_attention


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim // 2), float32."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = causal_attention(q, k, v)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


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
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    loss_scale: float = 1.0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        return decoder_loss(self, tokens, labels, cos, sin)

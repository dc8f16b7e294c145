"""The pieces the decoder families (llama3, deepseek_v3) share: RMSNorm, RoPE on interleaved
pairs, the SwiGLU feed-forward, and the forward pass from token embeddings to this rank's share of the loss. Plain
PyTorch, written for tracing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): Llama's feed-forward, DeepSeek-V3's dense blocks and each expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def decoder_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """A decoder's forward: embed `tokens`, run each block of `model.layers` as block(h, cos, sin),
    norm, project to logits, and return the summed next-token loss divided by `model.loss_scale`
    (the builder sets it to the global batch's token count, so that the data-parallel ranks'
    outputs sum to the mean loss)."""
    h = model.tok_embeddings(tokens)
    for block in model.layers.values():
        h = block(h, cos, sin)
    logits = model.output(model.norm(h))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    return loss / model.loss_scale

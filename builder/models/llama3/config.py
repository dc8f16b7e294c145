"""Llama 3 shapes. No torch import: titan-build's cache-hit path reads these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan.builder.models.spec import Flavors


@dataclass(kw_only=True, frozen=True)
class LlamaConfig:
    dim: int
    """Model (residual stream) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads per attention layer."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    vocab_size: int
    """Embedding rows and output logits."""
    multiple_of: int
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None
    """Scales the SwiGLU hidden width before rounding."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Published Llama 3.x shapes. `1B` is Llama 3.2 1B with untied output weights.
FLAVORS = Flavors(default="8B", shapes={
    "debug": LlamaConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=2048,
                         multiple_of=64, ffn_dim_multiplier=None),
    "1B": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      multiple_of=256, ffn_dim_multiplier=1.5),
    "8B": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      multiple_of=1024, ffn_dim_multiplier=1.3),
    "70B": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       multiple_of=4096, ffn_dim_multiplier=1.3),
    "405B": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                        multiple_of=4096, ffn_dim_multiplier=1.2),
})

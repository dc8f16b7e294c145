"""Llama 3 shapes. No torch import: titan-build's cache-hit path reads these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan.builder.models.attention import without_default_attention
from titan.builder.models.shape import require_positive
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
    ffn_dim: int | None = None
    """The SwiGLU hidden width, when set (titan-build --ffn-dim); None: derived from dim,
    ffn_dim_multiplier and multiple_of as Llama 3 does."""
    attention: str = "sdpa"
    """sdpa or flex (builder/models/attention.py; titan-build --attention)."""
    mask: str = "causal"
    """causal, or document: flex attention within each document (titan-build --mask)."""
    eos_id: int | None = None
    """With the document mask: the token that ends each document (titan-build --eos-id)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def n_params(self) -> int:
        """Parameters of the whole model (untied embedding and output)."""
        kv = self.n_kv_heads * self.head_dim
        block = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim

    def as_dict(self) -> dict:
        return without_default_attention(dataclasses.asdict(self))


def check_shape(cfg: LlamaConfig) -> None:
    """Llama's rules for its own dimensions (ModelSpec.check_shape)."""
    require_positive(cfg, ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of"))
    if cfg.ffn_dim is not None:
        require_positive(cfg, ("ffn_dim",))
    if cfg.dim % cfg.n_heads:
        raise ValueError(f"dim {cfg.dim} is not a multiple of n_heads {cfg.n_heads} (each head gets dim / n_heads "
                         "dimensions); pick a width or a head count that divides it")
    if cfg.head_dim % 2:
        raise ValueError(f"the head width dim / n_heads = {cfg.head_dim} is odd (RoPE rotates pairs of dimensions); "
                         "pick dim and n_heads so that it is even")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"n_kv_heads {cfg.n_kv_heads} does not divide n_heads {cfg.n_heads} (grouped-query "
                         "attention shares each key/value head among n_heads / n_kv_heads query heads)")


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

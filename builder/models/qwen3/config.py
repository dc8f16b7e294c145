"""Qwen3 shapes, dense and mixture of experts. No torch import: titan-build's cache-hit path
reads these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan.builder.models.attention import without_default_attention
from titan.builder.models.moe import without_default_etp
from titan.builder.models.shape import require_positive
from titan.builder.models.spec import Flavors
from titan.builder.spec.stage_split import StageCosts, decoder_costs


@dataclass(kw_only=True, frozen=True)
class Qwen3Config:
    dim: int
    """Model (residual stream) width (transformers: hidden_size)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads per attention layer."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Width of each head: explicit, not dim / n_heads (0.6B: 16 heads of 128 in a width of 1024)."""
    vocab_size: int
    """Embedding rows and output logits."""
    ffn_hidden: int
    """Hidden width of the dense SwiGLU feed-forward (transformers: intermediate_size); in a
    mixture-of-experts flavor, that of the blocks without experts, if any."""
    tie_embeddings: bool
    """The output projection is the embedding (one parameter): the small dense models."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (the blocks' norms and the per-head q/k norms)."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    n_experts: int = 0
    """Routed experts per mixture-of-experts block; 0: a dense model."""
    top_k: int = 0
    """Routed experts per token."""
    moe_hidden: int = 0
    """Hidden width of each routed expert (transformers: moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """The chosen experts' softmax probabilities are renormalized to sum to one."""
    decoder_sparse_step: int = 1
    """Block i has experts when (i + 1) is a multiple of this (and i is not in mlp_only_layers)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks that keep the dense feed-forward in a mixture-of-experts model."""
    attention: str = "sdpa"
    """sdpa or flex (builder/models/attention.py; titan-build --attention)."""
    mask: str = "causal"
    """causal, or document: flex attention within each document (titan-build --mask)."""
    eos_id: int | None = None
    """With the document mask: the token that ends each document (titan-build --eos-id)."""
    etp: int = 1
    """Expert tensor-parallel degree (titan-build --etp): 1, or the --tp degree to split each
    routed expert's hidden width over the tp ranks (builder/models/moe/expert_tp.py). Left out
    of as_dict at 1."""

    def __post_init__(self):
        # The manifest's JSON gives a list back (config_from_dict).
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    @property
    def attention_params(self) -> int:
        """One block's attention (with its query/key norms) and its two norms."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.dim * q + 2 * self.dim * kv + q * self.dim + 2 * self.head_dim + 2 * self.dim

    def feed_forward_params(self, layer: int, *, experts: int | None = None) -> int:
        """Block `layer`'s dense feed-forward, or its router and `experts` routed experts (default: all)."""
        if not self.is_moe_layer(layer):
            return 3 * self.dim * self.ffn_hidden
        experts = self.n_experts if experts is None else experts
        return self.n_experts * self.dim + 3 * self.dim * self.moe_hidden * experts

    @property
    def n_params(self) -> int:
        """Parameters of the whole model (every routed expert counted; a tied output once)."""
        blocks = sum(self.attention_params + self.feed_forward_params(i) for i in range(self.n_layers))
        return (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim + blocks + self.dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has routed experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.n_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def leading_layers(self) -> int:
        """The first blocks that differ from the repeated last one: up to the last block whose
        kind (dense or experts) is not the last block's (all of them when the kinds alternate)."""
        last = self.is_moe_layer(self.n_layers - 1)
        odd = [i for i in range(self.n_layers) if self.is_moe_layer(i) != last]
        return odd[-1] + 1 if odd else 0

    def as_dict(self) -> dict:
        return without_default_etp(without_default_attention(dataclasses.asdict(self)))


_QWEN3 = dict(vocab_size=151936, head_dim=128)
_MOE = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())

def check_shape(cfg: Qwen3Config) -> None:
    """Qwen3's rules for its own dimensions (ModelSpec.check_shape)."""
    require_positive(cfg, ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_hidden"))
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim {cfg.head_dim} is odd (RoPE rotates pairs of dimensions); pick an even head width")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"n_kv_heads {cfg.n_kv_heads} does not divide n_heads {cfg.n_heads} (grouped-query "
                         "attention shares each key/value head among n_heads / n_kv_heads query heads)")
    if cfg.n_experts:
        require_positive(cfg, ("top_k", "moe_hidden", "decoder_sparse_step"))
        if cfg.top_k > cfg.n_experts:
            raise ValueError(f"top_k {cfg.top_k} is more than the {cfg.n_experts} routed experts; pick top_k <= n_experts")


# Published Qwen3 shapes (Hugging Face Qwen/Qwen3-*, config.json). The dense models up to 4B
# tie their output projection to the embedding. `debug` (dense, tied) and `debug-moe` are
# CPU-sized; debug-moe's 8 experts with 3 chosen let a token reach experts on several
# expert-parallel ranks, and its first block is dense (mlp_only_layers) as an HF config may ask.
FLAVORS = Flavors(default="8B", shapes={
    "debug": Qwen3Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512,
                         ffn_hidden=128, tie_embeddings=True),
    "0.6B": Qwen3Config(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=3072, tie_embeddings=True,
                        **_QWEN3),
    "1.7B": Qwen3Config(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=6144, tie_embeddings=True,
                        **_QWEN3),
    "4B": Qwen3Config(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=9728, tie_embeddings=True,
                      **_QWEN3),
    "8B": Qwen3Config(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=12288, tie_embeddings=False,
                      **_QWEN3),
    "14B": Qwen3Config(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden=17408, tie_embeddings=False,
                       **_QWEN3),
    "32B": Qwen3Config(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden=25600, tie_embeddings=False,
                       **_QWEN3),
    "debug-moe": Qwen3Config(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512,
                             ffn_hidden=128, tie_embeddings=False, n_experts=8, top_k=3, moe_hidden=32,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(0,)),
    "30B-A3B": Qwen3Config(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden=6144, tie_embeddings=False,
                           n_experts=128, top_k=8, moe_hidden=768, **_QWEN3, **_MOE),
    "235B-A22B": Qwen3Config(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden=12288,
                             tie_embeddings=False, n_experts=128, top_k=8, moe_hidden=1536, **_QWEN3, **_MOE),
})


def stage_costs(cfg: Qwen3Config, seq_len: int) -> StageCosts:
    """Pipeline stage costs (builder/spec/stage_split.py): a MoE block costs its attention, router
    and top_k routed experts. Only untied flavors are split (layout_fit.py)."""
    blocks = [(cfg.attention_params + cfg.feed_forward_params(i),
               cfg.attention_params + cfg.feed_forward_params(i, experts=cfg.top_k),
               3 * cfg.dim * cfg.moe_hidden * cfg.n_experts if cfg.is_moe_layer(i) else 0)
              for i in range(cfg.n_layers)]
    return decoder_costs(dim=cfg.dim, vocab_size=cfg.vocab_size, seq_len=seq_len,
                         attention_width=2 * cfg.n_heads * cfg.head_dim, blocks=blocks)

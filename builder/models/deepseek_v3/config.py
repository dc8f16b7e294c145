"""DeepSeek-V3 shapes. No torch import: titan-build's cache-hit path reads these."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class DeepSeekV3Config:
    dim: int
    """Model (residual stream) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_dense_layers: int
    """The first blocks use a dense SwiGLU feed-forward instead of the mixture of experts."""
    n_heads: int
    """Attention heads (MLA: every head has its own key and value, decompressed from a shared latent)."""
    vocab_size: int
    """Embedding rows and output logits."""
    dense_hidden: int
    """Hidden width of the dense feed-forward blocks."""
    moe_hidden: int
    """Hidden width of each routed and shared expert."""
    n_routed_experts: int
    """Experts the router chooses from."""
    n_shared_experts: int
    """Experts every token goes through (one SwiGLU of width n_shared_experts * moe_hidden)."""
    top_k: int
    """Routed experts per token."""
    n_expert_groups: int = 1
    """Group-limited routing: the experts are split into this many groups ..."""
    n_limited_groups: int = 1
    """... and each token picks its top_k experts inside its best n_limited_groups groups."""
    route_scale: float = 1.0
    """The routing weights (normalized over the chosen experts) are multiplied by this."""
    q_lora_rank: int = 0
    """Rank of the low-rank query projection; 0: a plain (full-rank) query projection."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dims with rotary embedding (the key part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value dims."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_factor: float = 1.0
    """YaRN context extension factor (1: plain RoPE)."""
    rope_original_seq_len: int = 4096
    """YaRN: the context length the model was pre-trained with."""
    rope_beta_fast: int = 32
    """YaRN: rotations per context below which a frequency is interpolated ..."""
    rope_beta_slow: int = 1
    """... and above which it is kept (linear ramp between)."""
    rope_mscale: float = 1.0
    """YaRN attention temperature: the softmax scale is multiplied by yarn_mscale(factor, this)**2."""
    bias_update_rate: float = 1e-3
    """Auxiliary-loss-free balancing: each step every expert's routing bias moves by this much
    towards the mean load (up when under-loaded, down when over-loaded)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope_factor > 1.0:
            m = 0.1 * self.rope_mscale * math.log(self.rope_factor) + 1.0
            scale *= m * m
        return scale

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Published shapes. `671B` is DeepSeek-V3 (and V3.1/R1) without the multi-token-prediction
# layer. `16B` is DeepSeek-V2-Lite's shapes with V3's sigmoid routing, as torchtitan's 16B
# flavor. `debug` is CPU-sized: 8 experts in 4 groups, 3 chosen from the best 2 groups, so the
# group-limited routing runs and a token can go to experts on several expert-parallel ranks.
FLAVORS: dict[str, DeepSeekV3Config] = {
    "debug": DeepSeekV3Config(
        dim=64, n_layers=3, n_dense_layers=1, n_heads=4, vocab_size=512, dense_hidden=128,
        moe_hidden=32, n_routed_experts=8, n_shared_experts=1, top_k=3, n_expert_groups=4,
        n_limited_groups=2, route_scale=1.0, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16),
    "16B": DeepSeekV3Config(
        dim=2048, n_layers=27, n_dense_layers=1, n_heads=16, vocab_size=102400, dense_hidden=10944,
        moe_hidden=1408, n_routed_experts=64, n_shared_experts=2, top_k=6, q_lora_rank=0,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "671B": DeepSeekV3Config(
        dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, vocab_size=129280, dense_hidden=18432,
        moe_hidden=2048, n_routed_experts=256, n_shared_experts=1, top_k=8, n_expert_groups=8,
        n_limited_groups=4, route_scale=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_factor=40.0, rope_original_seq_len=4096,
        rope_beta_fast=32, rope_beta_slow=1, rope_mscale=1.0),
}
DEFAULT_FLAVOR = "16B"

"""DeepSeek-V3 shapes. No torch import: titan-build's cache-hit path reads these."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from titan.builder.models.attention import without_default_attention
from titan.builder.models.moe import without_default_etp
from titan.builder.models.shape import require_positive
from titan.builder.models.spec import Flavors


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
    n_expert_groups: int
    """Group-limited routing: the experts are split into this many groups ..."""
    n_limited_groups: int
    """... and each token picks its top_k experts inside its best n_limited_groups groups."""
    route_scale: float
    """The routing weights (normalized over the chosen experts) are multiplied by this."""
    q_lora_rank: int
    """Rank of the low-rank query projection; 0: a plain (full-rank) query projection."""
    kv_lora_rank: int
    """Width of the compressed key/value latent."""
    qk_nope_head_dim: int
    """Per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head query/key dims with rotary embedding (the key part is shared by all heads)."""
    v_head_dim: int
    """Per-head value dims."""
    norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """RoPE base frequency."""
    rope_factor: float
    """YaRN context extension factor (1: plain RoPE)."""
    rope_original_seq_len: int
    """YaRN: the context length the model was pre-trained with."""
    rope_beta_fast: int
    """YaRN: rotations per context below which a frequency is interpolated ..."""
    rope_beta_slow: int
    """... and above which it is kept (linear ramp between)."""
    rope_mscale: float
    """YaRN attention temperature: the softmax scale is multiplied by yarn_mscale(factor, this)**2."""
    bias_update_rate: float
    """Auxiliary-loss-free balancing: each step every expert's routing bias moves by this much
    towards the mean load (up when under-loaded, down when over-loaded)."""
    etp: int = 1
    """Expert tensor-parallel degree (titan-build --etp): 1, or the --tp degree to split each
    routed expert's hidden width over the tp ranks (builder/models/moe/expert_tp.py). Left out
    of as_dict at 1."""
    attention: str = "sdpa"
    """sdpa or flex (builder/models/attention.py; titan-build --attention). Flex takes MLA's
    value head size as it is (no padding to the query/key size, as SDPA needs)."""
    mask: str = "causal"
    """causal, or document: flex attention within each document (titan-build --mask)."""
    eos_id: int | None = None
    """With the document mask: the token that ends each document (titan-build --eos-id)."""

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

    @property
    def attention_params(self) -> int:
        """One block's attention and its two norms."""
        q = (self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.n_heads * self.qk_head_dim
             if self.q_lora_rank else self.dim * self.n_heads * self.qk_head_dim)
        return (q + self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                + self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
                + self.n_heads * self.v_head_dim * self.dim + 2 * self.dim)

    def feed_forward_params(self, *, moe: bool, experts: int | None = None) -> int:
        """A dense block's feed-forward, or a MoE block's router, shared experts and `experts`
        routed ones (default: all of them)."""
        if not moe:
            return 3 * self.dim * self.dense_hidden
        experts = self.n_routed_experts if experts is None else experts
        return self.n_routed_experts * self.dim + 3 * self.dim * self.moe_hidden * (experts + self.n_shared_experts)

    @property
    def n_params(self) -> int:
        """Parameters of the whole model, every routed expert counted."""
        return (2 * self.vocab_size * self.dim + self.dim + self.n_layers * self.attention_params
                + self.n_dense_layers * self.feed_forward_params(moe=False)
                + self.n_moe_layers * self.feed_forward_params(moe=True))

    def as_dict(self) -> dict:
        return without_default_etp(without_default_attention(dataclasses.asdict(self)))


def check_shape(cfg: DeepSeekV3Config) -> None:
    """DeepSeek-V3's rules for its own dimensions (ModelSpec.check_shape)."""
    require_positive(cfg, ("dim", "n_layers", "n_heads", "vocab_size", "dense_hidden", "moe_hidden",
                           "n_routed_experts", "top_k", "n_expert_groups", "n_limited_groups", "kv_lora_rank",
                           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if cfg.n_dense_layers > cfg.n_layers:
        raise ValueError(f"n_dense_layers {cfg.n_dense_layers} is more than n_layers {cfg.n_layers}")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim {cfg.qk_rope_head_dim} is odd (RoPE rotates pairs of dimensions)")
    if cfg.n_routed_experts % cfg.n_expert_groups:
        raise ValueError(f"n_expert_groups {cfg.n_expert_groups} does not divide n_routed_experts "
                         f"{cfg.n_routed_experts} (the experts are split into equal groups)")
    if cfg.n_limited_groups > cfg.n_expert_groups:
        raise ValueError(f"n_limited_groups {cfg.n_limited_groups} is more than n_expert_groups {cfg.n_expert_groups}")
    per_group = cfg.n_routed_experts // cfg.n_expert_groups
    if cfg.n_limited_groups < cfg.n_expert_groups and per_group < 2:
        raise ValueError(f"group-limited routing scores a group by its two best experts, but each of the "
                         f"{cfg.n_expert_groups} groups has {per_group}; use fewer groups or n_limited_groups = "
                         "n_expert_groups")
    if cfg.top_k > cfg.n_limited_groups * per_group:
        raise ValueError(f"top_k {cfg.top_k} is more than the {cfg.n_limited_groups * per_group} experts a token "
                         f"can choose from (n_limited_groups x experts per group)")


# Published shapes. `671B` is DeepSeek-V3 (and V3.1/R1) without the multi-token-prediction
# layer. `16B` is DeepSeek-V2-Lite's shapes with V3's sigmoid routing, as torchtitan's 16B
# flavor. `debug` is CPU-sized: 8 experts in 4 groups, 3 chosen from the best 2 groups, so the
# group-limited routing runs and a token can go to experts on several expert-parallel ranks.
# `16B-4L` is 16B cut to its first 4 layers (1 dense, 3 MoE): the published widths on one GPU
# (benchmarks/gpu/gpu_deepseek.sh). One row per field, one column per flavor.
_PUBLISHED = """
                          debug      16B     671B   16B-4L
dim                          64     2048     7168     2048
n_layers                      3       27       61        4
n_dense_layers                1        1        3        1
n_heads                       4       16      128       16
vocab_size                  512   102400   129280   102400
dense_hidden                128    10944    18432    10944
moe_hidden                   32     1408     2048     1408
n_routed_experts              8       64      256       64
n_shared_experts              1        2        1        2
top_k                         3        6        8        6
n_expert_groups               4        1        8        1
n_limited_groups              2        1        4        1
route_scale                 1.0      1.0      2.5      1.0
q_lora_rank                  32        0     1536        0
kv_lora_rank                 32      512      512      512
qk_nope_head_dim             16      128      128      128
qk_rope_head_dim              8       64       64       64
v_head_dim                   16      128      128      128
norm_eps                   1e-6     1e-6     1e-6     1e-6
rope_theta                  1e4      1e4      1e4      1e4
rope_factor                 1.0      1.0     40.0      1.0
rope_original_seq_len      4096     4096     4096     4096
rope_beta_fast               32       32       32       32
rope_beta_slow                1        1        1        1
rope_mscale                 1.0      1.0      1.0      1.0
bias_update_rate           1e-3     1e-3     1e-3     1e-3
"""


def _flavors(table: str) -> dict[str, DeepSeekV3Config]:
    """The table's columns as configs, each value parsed as its field's type."""
    names, *rows = [line.split() for line in table.strip().splitlines()]
    parse = {f.name: {"int": int, "float": float}.get(f.type) for f in dataclasses.fields(DeepSeekV3Config)}
    values: dict[str, dict] = {name: {} for name in names}
    for field, *column in rows:
        for name, value in zip(names, column, strict=True):
            values[name][field] = parse[field](value)
    return {name: DeepSeekV3Config(**fields) for name, fields in values.items()}


FLAVORS = Flavors(default="16B", shapes=_flavors(_PUBLISHED))

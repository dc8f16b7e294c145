"""DeepSeek-V3 as Hugging Face transformers' DeepseekV3ForCausalLM: the transformers config of
a flavor, and the checkpoint record (runtime/contract/hf_record.py) that --init-from-hf and
titan-export read: each parameter's tensor name and the config.json values of the same model.

Checkpoints keep one tensor per routed expert (`mlp.experts.{i}.gate_proj.weight`: the
published DeepSeek-V3 checkpoints, and what transformers' save_pretrained writes, although it
fuses them as `gate_up_proj` in memory); titan stacks them on dim 0 of w1 / w2 / w3, so those
are `stacked` entries of the record, and an expert-parallel rank reads its own experts only.
Both lay the RoPE dims out as interleaved pairs (transformers' `rope_interleave=True`), so no
row is permuted. The auxiliary-loss-free balancing bias is a buffer, not a parameter, but the
checkpoint carries it (`e_score_correction_bias`), so the record names it too.

No torch import: titan-build's cache-hit path writes the record.
"""

from __future__ import annotations

from titan.builder.models.deepseek_v3.config import DeepSeekV3Config
from titan.builder.models.hf_names import hf_name as shared_hf_name, stacked_expert_names
from titan.runtime.contract.hf_record import ROPE_PREFIX, HFRecord

_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    # Dense blocks' feed-forward, and the MoE blocks' shared experts (one SwiGLU).
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
}
# transformers.DeepseekV3Config arguments that say how to build the module, not what a
# checkpoint holds (a published config.json may lack them): not checked against checkpoints.
_MODULE_ONLY = ("rope_interleave", "tie_word_embeddings")
BALANCING_BIAS = "feed_forward.expert_bias"
"""The MoE blocks' buffer that a checkpoint holds (the other MoE buffers are per-step counts)."""


def hf_config_kwargs(cfg: DeepSeekV3Config) -> dict:
    """transformers.DeepseekV3Config arguments for the same model: the one place that says how
    a titan flavor reads in transformers' terms (the checkpoint record derives from it)."""
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.dense_hidden,
        moe_intermediate_size=cfg.moe_hidden, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads, n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts, routed_scaling_factor=cfg.route_scale,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_expert_groups, topk_group=cfg.n_limited_groups, num_experts_per_tok=cfg.top_k,
        first_k_dense_replace=cfg.n_dense_layers, norm_topk_prob=True, rms_norm_eps=cfg.norm_eps,
        hidden_act="silu", rope_interleave=True, tie_word_embeddings=False, attention_bias=False)
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_factor > 1.0:
        # titan applies one YaRN temperature (rope_mscale) to the softmax scale; transformers
        # splits it into mscale / mscale_all_dim, whose ratio scales cos and sin: equal, so 1.
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_seq_len, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale}
    kwargs["rope_parameters"] = rope
    return kwargs


def hf_name(fqn: str) -> str:
    """The checkpoint tensor of a parameter that is not stacked."""
    return shared_hf_name(fqn, _BLOCK_NAMES)


def hf_checkpoint(cfg: DeepSeekV3Config, fqns: list[str]) -> HFRecord:
    kwargs = hf_config_kwargs(cfg)
    rope = kwargs.pop("rope_parameters")
    config = {k: v for k, v in kwargs.items() if v is not None and k not in _MODULE_ONLY}
    config["rope_theta"] = rope["rope_theta"]
    config.update({ROPE_PREFIX + k: v for k, v in rope.items() if k != "rope_theta"})
    biases = [f"layers.{i}.{BALANCING_BIAS}" for i in range(cfg.n_dense_layers, cfg.n_layers)]
    stacked = stacked_expert_names(fqns)
    return HFRecord(
        model_type="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
        config=config,
        names={fqn: hf_name(fqn) for fqn in [*fqns, *biases] if fqn not in stacked},
        tied_names={},
        rope_permuted={},
        stacked=stacked,
    )

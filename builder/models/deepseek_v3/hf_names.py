"""Hugging Face transformers' DeepseekV3ForCausalLM in titan's names.

Both lay RoPE dims out as interleaved pairs (transformers' `rope_interleave=True`, the
published checkpoints' layout), so no permutation is needed. transformers stacks each layer's
routed experts as `gate_up_proj` (experts, 2 * hidden, dim) and `down_proj` (experts, dim,
hidden): titan's w1 and w3 are its two halves, w2 is down_proj.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from titan.builder.models.deepseek_v3.config import DeepSeekV3Config

_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_config_kwargs(cfg: DeepSeekV3Config) -> dict:
    """transformers.DeepseekV3Config arguments for the same shapes."""
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.dense_hidden,
        moe_intermediate_size=cfg.moe_hidden, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads, n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts, routed_scaling_factor=cfg.route_scale,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_expert_groups, topk_group=cfg.n_limited_groups, num_experts_per_tok=cfg.top_k,
        first_k_dense_replace=cfg.n_dense_layers, norm_topk_prob=True, rms_norm_eps=cfg.norm_eps,
        rope_interleave=True, tie_word_embeddings=False, attention_bias=False)
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_factor > 1.0:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_seq_len, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale}
    kwargs["rope_parameters"] = rope
    return kwargs


def from_hf(hf: Mapping[str, torch.Tensor], cfg: DeepSeekV3Config) -> dict[str, torch.Tensor]:
    """titan's parameters and MoE balancing biases, by fully qualified name, from a
    DeepseekV3ForCausalLM state dict."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
           "output.weight": hf["lm_head.weight"]}
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attention_norm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "ffn_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
        for ours, theirs in _ATTENTION.items():
            if src + f"self_attn.{theirs}.weight" in hf:
                out[dst + f"attention.{ours}.weight"] = hf[src + f"self_attn.{theirs}.weight"]
        if i < cfg.n_dense_layers:
            for ours, theirs in _SWIGLU.items():
                out[dst + f"feed_forward.{ours}.weight"] = hf[src + f"mlp.{theirs}.weight"]
            continue
        out[dst + "feed_forward.gate.weight"] = hf[src + "mlp.gate.weight"]
        out[dst + "feed_forward.expert_bias"] = hf[src + "mlp.gate.e_score_correction_bias"]
        w1, w3 = hf[src + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
        out[dst + "feed_forward.w1"], out[dst + "feed_forward.w3"] = w1, w3
        out[dst + "feed_forward.w2"] = hf[src + "mlp.experts.down_proj"]
        if cfg.n_shared_experts:
            shared_src, shared_dst = src + "mlp.shared_experts.", dst + "feed_forward.shared_experts."
            for ours, theirs in _SWIGLU.items():
                out[shared_dst + f"{ours}.weight"] = hf[shared_src + f"{theirs}.weight"]
    return out

"""Qwen3 as Hugging Face transformers' Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM: the
transformers config of a flavor, and the checkpoint record (runtime/contract/hf_record.py) that
--init-from-hf and titan-export read: each parameter's tensor name and the config.json values of
the same model.

- RoPE: transformers rotates halves, titan interleaved pairs, so the rows of q_proj and k_proj
  are permuted within each head, and so are the entries of the per-head q/k norm weights
  (a norm over the head's entries does not care about their order; its weight does).
- Routed experts: one tensor per expert (`mlp.experts.{i}.gate_proj.weight`, what published
  checkpoints hold and transformers' save_pretrained writes), stacked on dim 0 of w1 / w2 / w3.
- A tied flavor has no output projection of its own: the checkpoint must say
  tie_word_embeddings and holds the embedding only; an untied flavor reads lm_head.

No torch import: titan-build's cache-hit path writes the record.
"""

from __future__ import annotations

from titan.builder.models.qwen3.config import Qwen3Config
from titan.builder.models.hf_names import hf_name as shared_hf_name, stacked_expert_names
from titan.runtime.contract.hf_record import HFRecord

_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.gate.weight": "mlp.gate.weight",
}
# Rows (entries) in rotate-half order within each head in a Hugging Face checkpoint.
_ROPE_PERMUTED = ("attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight")


def hf_config_kwargs(cfg: Qwen3Config) -> dict:
    """transformers.Qwen3Config (or Qwen3MoeConfig) arguments for the same model: the one place
    that says how a titan flavor reads in transformers' terms (the checkpoint record derives
    from it)."""
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, hidden_act="silu", attention_bias=False,
        use_sliding_window=False, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if cfg.moe:
        kwargs.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_hidden,
                      norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                      mlp_only_layers=list(cfg.mlp_only_layers))
    return kwargs


def hf_name(fqn: str) -> str:
    """The checkpoint tensor of a parameter that is not stacked."""
    return shared_hf_name(fqn, _BLOCK_NAMES)


def hf_checkpoint(cfg: Qwen3Config, fqns: list[str]) -> HFRecord:
    config = hf_config_kwargs(cfg)
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    stacked = stacked_expert_names(fqns)
    return HFRecord(
        model_type="qwen3_moe" if cfg.moe else "qwen3",
        architectures=("Qwen3MoeForCausalLM" if cfg.moe else "Qwen3ForCausalLM",),
        config=config,
        names={fqn: hf_name(fqn) for fqn in fqns if fqn not in stacked},
        # None: tie_word_embeddings is part of `config`, so only a flavor tied as the checkpoint
        # is reads it.
        tied_names={},
        rope_permuted={fqn: cfg.head_dim for fqn in fqns if fqn.endswith(_ROPE_PERMUTED)},
        stacked=stacked,
    )

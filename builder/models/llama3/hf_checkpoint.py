"""Llama 3 as a Hugging Face LlamaForCausalLM: the tensor name of each parameter, the q/k rows
stored in HF's rotate-half order, and the config.json values that describe the same model.

The builder writes this record (runtime/contract/hf_record.py) into the manifest; runtime/hf_weights.py
reads checkpoints (--init-from-hf) and titan-export writes them from it alone.
"""

from __future__ import annotations

from titan.builder.models.llama3.config import LlamaConfig
from titan.builder.models.hf_names import TOP_NAMES, hf_name as shared_hf_name
from titan.runtime.contract.hf_record import HFRecord

_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# HF stores q_proj / k_proj rows permuted for its rotate-half RoPE (titan's pairs are interleaved).
_ROPE_PERMUTED = ("attention.wq.weight", "attention.wk.weight")


def hf_name(fqn: str) -> str:
    """The Hugging Face tensor that holds titan parameter `fqn`."""
    return shared_hf_name(fqn, _BLOCK_NAMES)


def hf_checkpoint(cfg: LlamaConfig, fqns: list[str]) -> HFRecord:
    return HFRecord(
        model_type="llama",
        architectures=("LlamaForCausalLM",),
        config={
            "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size,
            "intermediate_size": cfg.ffn_hidden, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        },
        names={fqn: hf_name(fqn) for fqn in fqns},
        # With tie_word_embeddings the output projection is the embedding.
        tied_names={"output.weight": TOP_NAMES["tok_embeddings.weight"]},
        rope_permuted={fqn: cfg.head_dim for fqn in fqns if fqn.endswith(_ROPE_PERMUTED)},
    )

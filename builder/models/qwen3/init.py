"""How Qwen3's parameters are initialized (torchtitan's scheme, as Llama 3 and DeepSeek-V3), by
fully qualified name. The runtime materializes parameters from these specs alone (it never sees
model code), so the eager reference initializes through the same specs. No torch import."""

from __future__ import annotations

import math

from titan.builder.models.qwen3.config import Qwen3Config


def _trunc(std: float, bound: float = 2.0) -> dict:
    return {"kind": "trunc_normal", "std": std, "a": -bound, "b": bound}


def init_specs(cfg: Qwen3Config) -> dict[str, dict]:
    """A tied model has no `output.weight`: its one embedding is drawn at the output's scale
    (dim ** -0.5), which keeps the first logits small; the routed experts' stacked weights are
    drawn whole, so every expert layout starts alike."""
    base_std = 0.02
    out_std = cfg.dim ** -0.5
    specs: dict[str, dict] = {"tok_embeddings.weight": (_trunc(out_std, 3 * out_std) if cfg.tie_embeddings
                                                        else {"kind": "normal", "std": 1.0})}
    for i in range(cfg.n_layers):
        depth_std = base_std / math.sqrt(2 * (i + 1))
        p = f"layers.{i}."
        for name in ("attention_norm.weight", "ffn_norm.weight", "attention.q_norm.weight", "attention.k_norm.weight"):
            specs[p + name] = {"kind": "ones"}
        for name in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"):
            specs[p + name] = _trunc(base_std)
        specs[p + "attention.wo.weight"] = _trunc(depth_std)
        if cfg.is_moe_layer(i):
            specs[p + "feed_forward.gate.weight"] = _trunc(depth_std)
            suffix = ""
        else:
            suffix = ".weight"
        specs[p + "feed_forward.w1" + suffix] = _trunc(base_std)
        specs[p + "feed_forward.w2" + suffix] = _trunc(depth_std)
        specs[p + "feed_forward.w3" + suffix] = _trunc(depth_std)
    specs["norm.weight"] = {"kind": "ones"}
    if not cfg.tie_embeddings:
        specs["output.weight"] = _trunc(out_std, 3 * out_std)
    return specs

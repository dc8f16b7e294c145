"""How DeepSeek-V3's parameters are initialized (torchtitan's scheme), by fully qualified name.

The runtime materializes parameters from these specs alone (it never sees model code), so the
eager reference initializes through the same specs. No torch import.
"""

from __future__ import annotations

import math

from titan.builder.models.deepseek_v3.config import DeepSeekV3Config


def _trunc(std: float) -> dict:
    return {"kind": "trunc_normal", "std": std, "a": -2.0, "b": 2.0}


def _swiglu_specs(prefix: str, suffix: str, base_std: float, depth_std: float) -> dict[str, dict]:
    return {prefix + "w1" + suffix: _trunc(base_std), prefix + "w2" + suffix: _trunc(depth_std),
            prefix + "w3" + suffix: _trunc(depth_std)}


def init_specs(cfg: DeepSeekV3Config) -> dict[str, dict]:
    """How each parameter is initialized (torchtitan's scheme), by fully qualified name. The
    routed experts' stacked weights are drawn whole, so every expert layout starts alike."""
    base_std = 0.02
    specs: dict[str, dict] = {"tok_embeddings.weight": {"kind": "normal", "std": 1.0}}
    for i in range(cfg.n_layers):
        depth_std = base_std / math.sqrt(2 * (i + 1))
        p = f"layers.{i}."
        for name in ("attention_norm.weight", "ffn_norm.weight", "attention.kv_norm.weight"):
            specs[p + name] = {"kind": "ones"}
        if cfg.q_lora_rank:
            specs[p + "attention.q_norm.weight"] = {"kind": "ones"}
            specs[p + "attention.wq_a.weight"] = _trunc(base_std)
            specs[p + "attention.wq_b.weight"] = _trunc(base_std)
        else:
            specs[p + "attention.wq.weight"] = _trunc(base_std)
        specs[p + "attention.wkv_a.weight"] = _trunc(base_std)
        specs[p + "attention.wkv_b.weight"] = _trunc(base_std)
        specs[p + "attention.wo.weight"] = _trunc(depth_std)
        if i < cfg.n_dense_layers:
            specs.update(_swiglu_specs(p + "feed_forward.", ".weight", base_std, depth_std))
            continue
        specs[p + "feed_forward.gate.weight"] = _trunc(depth_std)
        specs.update(_swiglu_specs(p + "feed_forward.", "", base_std, depth_std))
        if cfg.n_shared_experts:
            specs.update(_swiglu_specs(p + "feed_forward.shared_experts.", ".weight", base_std, depth_std))
    specs["norm.weight"] = {"kind": "ones"}
    out_std = cfg.dim ** -0.5
    specs["output.weight"] = {"kind": "trunc_normal", "std": out_std, "a": -3 * out_std, "b": 3 * out_std}
    return specs

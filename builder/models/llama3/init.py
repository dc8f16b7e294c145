"""How each Llama 3 parameter is initialized (torchtitan's scheme), as data the runtime draws from."""

from __future__ import annotations

import math

from titan.builder.models.llama3.config import LlamaConfig


def init_specs(cfg: LlamaConfig) -> dict[str, dict]:
    """How each parameter is initialized (torchtitan's scheme), by fully qualified name.

    The runtime materializes parameters from these specs alone (it never sees model code),
    so the eager reference initializes through the same specs.
    """
    base_std = 0.02
    specs: dict[str, dict] = {"tok_embeddings.weight": {"kind": "normal", "std": 1.0}}
    for i in range(cfg.n_layers):
        depth_std = base_std / math.sqrt(2 * (i + 1))
        p = f"layers.{i}."
        for name in ("attention_norm.weight", "ffn_norm.weight"):
            specs[p + name] = {"kind": "ones"}
        for name in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                     "feed_forward.w1.weight"):
            specs[p + name] = {"kind": "trunc_normal", "std": base_std, "a": -2.0, "b": 2.0}
        for name in ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"):
            specs[p + name] = {"kind": "trunc_normal", "std": depth_std, "a": -2.0, "b": 2.0}
    specs["norm.weight"] = {"kind": "ones"}
    out_std = cfg.dim ** -0.5
    specs["output.weight"] = {"kind": "trunc_normal", "std": out_std, "a": -3 * out_std, "b": 3 * out_std}
    return specs

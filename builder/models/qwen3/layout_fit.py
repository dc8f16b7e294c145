"""Which parallel layouts a Qwen3 shape allows (the spec's check_layout)."""

from __future__ import annotations

from titan.builder.models.moe import check_expert_tp
from titan.builder.models.qwen3.config import Qwen3Config
from titan.builder.models.spec import require_divides
from titan.runtime.contract.layout import Layout


def check_layout(cfg: Qwen3Config, layout: Layout) -> None:
    """Tensor parallelism splits the query and key/value heads, the dense feed-forward width and
    the vocabulary (of the embedding and of the output projection alike, so a tied weight keeps
    one shard); --ep splits the routed experts of a mixture-of-experts flavor. FSDP pads uneven
    shards of dense weights (runtime/contract/shards.py); the stacked experts are cut on the
    expert dimension, which --dp-shard must divide (each rank holds whole experts)."""
    if layout.pp > 1 and cfg.tie_embeddings:
        # One weight on two pp ranks: its two gradients would have to be summed between them
        # before the clip (counted once in the norm) and the optimizer; stages do not share weights.
        raise ValueError(f"--pp {layout.pp}: this qwen3 flavor ties its output projection to the embedding, one "
                         "weight the first and the last stage would share, whose gradients would have to be summed "
                         "across the two stages (not built); use an untied flavor (8B, 14B, 32B, debug-moe, 30B-A3B, "
                         "235B-A22B) or --pp 1")
    dense_hidden = any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    require_divides("tp", layout.tp, {"attention heads": cfg.n_heads, "key/value heads": cfg.n_kv_heads,
                                      "vocabulary size": cfg.vocab_size,
                                      **({"feed-forward hidden width": cfg.ffn_hidden} if dense_hidden else {})})
    if not cfg.moe:
        if layout.ep > 1:
            raise ValueError(f"--ep {layout.ep}: this qwen3 flavor is dense (no routed experts to split); drop --ep "
                             "or pick a mixture-of-experts flavor (debug-moe, 30B-A3B, 235B-A22B)")
        return
    require_divides("ep", layout.ep, {"routed experts": cfg.n_experts})
    check_expert_tp(cfg.etp, layout, moe_hidden=cfg.moe_hidden)
    require_divides("dp-shard", layout.dp_shard, {"routed experts per --ep rank": cfg.n_experts // layout.ep})

"""Which parallel layouts a Llama 3 shape allows (the spec's check_layout)."""

from __future__ import annotations

from titan.builder.models.spec import require_divides
from titan.builder.models.llama3.config import LlamaConfig
from titan.runtime.contract.layout import Layout


def check_layout(cfg: LlamaConfig, layout: Layout) -> None:
    """Tensor parallelism splits the heads, the feed-forward width and the vocabulary, so --tp
    must divide each. --dp-shard need not divide anything: FSDP pads uneven shards to full
    chunks (runtime/contract/shards.py)."""
    require_divides("tp", layout.tp, {"attention heads": cfg.n_heads, "key/value heads": cfg.n_kv_heads,
                                      "feed-forward hidden width": cfg.ffn_hidden, "vocabulary size": cfg.vocab_size})

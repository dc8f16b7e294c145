"""Whether a parallel layout (runtime/layout.py) fits a Llama-shaped model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan.runtime.layout import MESH_DIMS, Layout

if TYPE_CHECKING:
    from titan.builder.models.llama3.config import LlamaConfig


def check_layout(cfg: LlamaConfig, layout: Layout) -> None:
    """Raise ValueError, naming the reason, when the layout does not divide the model."""
    for name in MESH_DIMS:
        if getattr(layout, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(layout, name)}")
    tp = layout.tp
    checks = [
        (cfg.n_heads, "attention heads"),
        (cfg.n_kv_heads, "key/value heads"),
        (cfg.ffn_hidden, "feed-forward hidden width"),
        (cfg.vocab_size, "vocabulary size"),
    ]
    for value, what in checks:
        if value % tp:
            raise ValueError(f"--tp {tp} does not divide the {what} ({value}); pick a --tp that divides it")
    shard = layout.dp_shard
    # FSDP shards dim 0 of each parameter's tensor-parallel slice.
    dim0s = {
        "embedding rows": cfg.vocab_size // tp,
        "model width": cfg.dim,
        "query projection rows": cfg.n_heads * cfg.head_dim // tp,
        "key/value projection rows": cfg.n_kv_heads * cfg.head_dim // tp,
        "feed-forward rows": cfg.ffn_hidden // tp,
        "output rows": cfg.vocab_size // tp,
    }
    for what, value in dim0s.items():
        if value % shard:
            raise ValueError(
                f"--dp-shard {shard} does not divide the {what} ({value}) of this model; "
                "pick a --dp-shard that divides it")

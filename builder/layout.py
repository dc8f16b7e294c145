"""Whether a parallel layout (runtime/contract/layout.py) fits a Llama-shaped model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan.runtime.contract.layout import MESH_DIMS, Layout

if TYPE_CHECKING:
    from titan.builder.models.llama3.config import LlamaConfig


def check_layout(cfg: LlamaConfig, layout: Layout) -> None:
    """Raise ValueError, naming the reason, when the layout does not fit the model (a --tp that
    does not divide it)."""
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
    # dp_shard need not divide anything: FSDP pads uneven shards to full chunks (runtime/shards.py).

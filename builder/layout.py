"""The parallel layout of a build: mesh dimensions, their sizes, and validation against a model."""

from __future__ import annotations

from dataclasses import dataclass

from titan.builder.models.llama3_config import LlamaConfig

from titan.runtime.validate import MESH_DIMS, rank_coordinates  # outermost first, as torchtitan orders them


@dataclass(kw_only=True, frozen=True)
class Layout:
    dp_replicate: int = 1
    """Plain data-parallel replicas (with dp_shard > 1: HSDP)."""
    dp_shard: int = 1
    """FSDP degree: parameters sharded on dim 0, all-gathered in forward."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """The mesh dimensions of size > 1, outermost first."""
        return tuple((name, getattr(self, name)) for name in MESH_DIMS if getattr(self, name) > 1)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each mesh dimension (row-major, tp innermost)."""
        return rank_coordinates(rank, {name: getattr(self, name) for name in MESH_DIMS})

    def tag(self) -> str:
        parts = [f"{name.replace('_', '-')}{size}" for name, size in self.mesh_shape()]
        return "-".join(parts) or "single"


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

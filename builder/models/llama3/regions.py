"""Llama 3's fusion region kinds, as fuse_regions needs them. Module paths are those of
model.py ('layers.3.attention.wq'); blocks are `layers.<n>`, the spec's default block naming."""

from __future__ import annotations


def region_kind(module: str) -> str | None:
    """The region kind of a node produced by `module`, or None (not fused)."""
    parts = module.split(".") if module else []
    if not parts:
        return "loss"  # the RoPE tables, the loss and its gradient: no module of their own
    if parts[-1] in ("attention_norm", "ffn_norm", "norm"):
        return "rms_norm"
    if len(parts) == 3 and parts[0] == "layers" and parts[2] == "attention":
        return "rope"
    if len(parts) == 3 and parts[0] == "layers" and parts[2] == "feed_forward":
        return "swiglu"
    return None

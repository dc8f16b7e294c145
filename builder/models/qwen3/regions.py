"""Qwen3's fusion region kinds, as fuse_regions needs them. Module paths are those of model.py
('layers.3.attention.q_norm'). The feed-forward is not a region: a block's `feed_forward` is a
dense SwiGLU or a mixture of experts, which a module path does not tell apart, and the
dispatch is not a SwiGLU region."""

from __future__ import annotations


def region_kind(module: str) -> str | None:
    """The region kind of a node produced by `module`, or None (not fused)."""
    parts = module.split(".") if module else []
    if not parts:
        return "loss"  # the RoPE tables, the loss and its gradient: no module of their own
    if parts[-1] in ("attention_norm", "ffn_norm", "norm", "q_norm", "k_norm"):
        return "rms_norm"
    if len(parts) == 3 and parts[0] == "layers" and parts[2] == "attention":
        return "rope"
    return None

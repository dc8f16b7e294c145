"""Llama 3's module names, as the passes need them: blocks, activation-checkpointing units and
fusion region kinds. Module paths are those of model.py ('layers.3.attention.wq')."""

from __future__ import annotations


def block_of(module: str) -> str:
    """'layers.3.attention.wq' -> 'layers.3'; 'output' -> 'output'."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def ac_block(module: str) -> int | None:
    """The transformer block a module belongs to (3 for 'layers.3.attention'), else None."""
    parts = module.split(".")
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 else None


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

"""Hugging Face names that the decoder families share (torch-free: titan-build's cache-hit path
writes the checkpoint record): the tensors outside the blocks, and a block tensor's name from a
family's table of its own."""

from __future__ import annotations

from titan.runtime.contract.hf_record import STACK_INDEX

TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
"""The embedding, the final norm and the output projection, as every decoder checkpoint names them."""
STACKED_EXPERT_NAMES = {
    "feed_forward.w1": f"mlp.experts.{STACK_INDEX}.gate_proj.weight",
    "feed_forward.w2": f"mlp.experts.{STACK_INDEX}.down_proj.weight",
    "feed_forward.w3": f"mlp.experts.{STACK_INDEX}.up_proj.weight",
}
"""A MoE block's stacked expert weights: one checkpoint tensor per expert (builder/models/moe)."""


def hf_name(fqn: str, block_names: dict[str, str]) -> str:
    """The checkpoint tensor of titan parameter (or buffer) `fqn` that is not stacked:
    `block_names` maps a block's own names (after `layers.<i>.`) to the family's."""
    if fqn in TOP_NAMES:
        return TOP_NAMES[fqn]
    parts = fqn.split(".", 2)
    assert parts[0] == "layers" and len(parts) == 3, fqn
    return f"model.layers.{parts[1]}.{block_names[parts[2]]}"


def stacked_expert_names(fqns: list[str]) -> dict[str, str]:
    """The stacked expert weights among `fqns`, each with its checkpoint name pattern."""
    stacked = {}
    for fqn in fqns:
        _, layer, rest = fqn.split(".", 2) if fqn.startswith("layers.") else ("", "", "")
        if rest in STACKED_EXPERT_NAMES:
            stacked[fqn] = f"model.layers.{layer}.{STACKED_EXPERT_NAMES[rest]}"
    return stacked

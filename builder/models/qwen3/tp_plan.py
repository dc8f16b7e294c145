"""Qwen3's tensor-parallel plan (with sequence parallel): Llama's (builder/models/decoder_tp.py)
for the embedding, attention, dense feed-forward and output; the per-head q/k norms see this
rank's heads (their weights' gradients summed over tp); a mixture of experts routes this rank's
sequence shard (with --etp, the whole sequence, each routed expert split over tp). A tied output projection is split on the vocabulary like the embedding, so the
tied weight keeps one shard per rank."""

from __future__ import annotations

from titan.builder.models.decoder_tp import (embedding_and_output_plan, gqa_attention_plan, routed_experts_plan,
                                             swiglu_plan)
from titan.builder.models.qwen3.model import Qwen3


def tp_plan(model: Qwen3) -> dict:
    plan = embedding_and_output_plan()
    for name, block in model.layers.items():
        p = f"layers.{name}."
        plan.update(gqa_attention_plan(p))
        plan.update(routed_experts_plan(p, expert_tp=model.cfg.etp > 1) if block.moe else swiglu_plan(p))
    return plan

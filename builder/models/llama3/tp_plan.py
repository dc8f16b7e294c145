"""Llama 3's tensor-parallel plan (with sequence parallel), as torchtitan's: the embedding is
vocab-parallel, attention and feed-forward projections are column- then row-parallel, and the
norms run sequence-parallel between them (builder/models/decoder_tp.py's pieces)."""

from __future__ import annotations

from titan.builder.models.decoder_tp import embedding_and_output_plan, gqa_attention_plan, swiglu_plan
from titan.builder.models.llama3.model import Llama3


def tp_plan(model: Llama3) -> dict:
    plan = embedding_and_output_plan()
    for name in model.layers:
        p = f"layers.{name}."
        plan.update(gqa_attention_plan(p))
        plan.update(swiglu_plan(p))
    return plan

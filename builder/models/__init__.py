"""The model registry: each family's spec by name (titan-build --model). A new family is a
folder beside llama3/ and one line here."""

from __future__ import annotations

from titan.builder.models import deepseek_v3, llama3, qwen3
from titan.builder.models.spec import ModelSpec

MODELS: dict[str, ModelSpec] = {
    "llama3": llama3.SPEC,
    "deepseek_v3": deepseek_v3.SPEC,
    "qwen3": qwen3.SPEC,
}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    return MODELS[name]

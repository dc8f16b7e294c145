"""The attention a decoder family's config may choose (titan-build --attention, --mask,
--eos-id): SDPA with the causal mask (the default), or FlexAttention with the causal or the
document mask (runtime/contract/flex_attention.py's op).

Every family offers the choice by having the three fields below in its config (Llama 3, Qwen3,
DeepSeek-V3, whose latent attention gives FlexAttention a value head size apart from the query's);
they go into the manifest's model config and the cache key only when they differ from the
defaults, so an SDPA build's config, key and name are what they were before the choice existed.
The document mask needs the token that ends each document (the separator titan-data appends,
its sidecar's `eos_id`): document ids are computed from it inside the step.

No torch import: titan-build's cache-hit path reads this.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ATTENTION_KINDS = ("sdpa", "flex")
MASK_KINDS = ("causal", "document")
DEFAULTS: dict[str, Any] = {"attention": "sdpa", "mask": "causal", "eos_id": None}
"""The config fields of the choice and their defaults (the fields a family's config declares)."""


def without_default_attention(values: dict) -> dict:
    """A config's as_dict() with the attention fields left out where they hold their defaults."""
    return {k: v for k, v in values.items() if k not in DEFAULTS or v != DEFAULTS[k]}


def attention_overrides(cfg: Any, *, model: str, attention: str, mask: str, eos_id: int | None) -> dict[str, Any]:
    """Validate the choice against the family's config `cfg`; returns the config fields to set
    (only those that differ from the defaults). ValueError names the fix."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown --attention {attention!r}; use {' or '.join(ATTENTION_KINDS)}")
    if mask not in MASK_KINDS:
        raise ValueError(f"unknown --mask {mask!r}; use {' or '.join(MASK_KINDS)}")
    chosen = {"attention": attention, "mask": mask, "eos_id": eos_id}
    changed = {k: v for k, v in chosen.items() if v != DEFAULTS[k]}
    if not changed:
        return {}
    fields = {f.name for f in dataclasses.fields(cfg)}
    assert all(f in fields for f in DEFAULTS), f"{model}'s config lacks the attention fields {list(DEFAULTS)}"
    if mask == "document" and attention != "flex":
        raise ValueError("--mask document needs --attention flex (SDPA runs the causal mask only)")
    if mask == "document" and eos_id is None:
        raise ValueError("--mask document needs --eos-id ID: the token that ends each document (titan-data prints "
                         "it as 'separator id ID'; its sidecar's eos_id)")
    if mask != "document" and eos_id is not None:
        raise ValueError("--eos-id is for --mask document only; drop it or add --attention flex --mask document")
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"--eos-id {eos_id} is outside the vocabulary of {cfg.vocab_size}; give the separator id "
                         "titan-data printed")
    return changed


def attention_tags(config: dict) -> list[str]:
    """The tags of a non-default choice in a config's as_dict() (the artifact's name, titan-cache
    ls): ['flex'], ['flex', 'doc-eos2047']."""
    if config.get("attention", DEFAULTS["attention"]) == "sdpa":
        return []
    return ["flex"] + ([f"doc-eos{config.get('eos_id')}"] if config.get("mask") == "document" else [])


def describe_attention(config: dict) -> str:
    """'sdpa causal', 'flex causal', 'flex document (eos id 2047)' from a manifest's model config."""
    kind, mask = config.get("attention", DEFAULTS["attention"]), config.get("mask", DEFAULTS["mask"])
    eos = config.get("eos_id")
    return f"{kind} {mask}" + ("" if eos is None else f" (eos id {eos})")

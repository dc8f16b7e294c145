"""A model of your own shape: dimensions set on top of a flavor (titan-build --dim 512
--vocab-size 32000, or --shape FIELD=VALUE for any field of the family's config).

The overrides are checked here as the built-in flavors are: each value against its field's
type, then the family's own shape rules (ModelSpec.check_shape: heads divide the width, ...);
the layout checks (a --tp that divides the heads, ...) then run on the result as for any
flavor. The result is an ordinary config: it goes into the manifest and the cache key, so a
custom shape is its own cache entry, and into the artifact's default name (`shape_tags`).

No torch import: titan-build's cache-hit path reads shapes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from titan.builder.models.attention import DEFAULTS as ATTENTION_FIELDS

if TYPE_CHECKING:
    from titan.builder.models.spec import ModelConfig, ModelSpec


def parse_shape_args(pairs: Iterable[str]) -> dict[str, str]:
    """'FIELD=VALUE' strings (titan-build --shape) -> {field: value text}."""
    out: dict[str, str] = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep or not field.strip() or not value.strip():
            raise ValueError(f"--shape {pair!r}: write FIELD=VALUE, e.g. --shape n_kv_heads=2")
        out[field.strip().replace("-", "_")] = value.strip()
    return out


def _field_type(field: dataclasses.Field) -> type:
    """int or float, from the field's annotation (a string under postponed evaluation)."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return int if "int" in annotation else float


def _convert(family: str, field: dataclasses.Field, value: Any) -> int | float:
    kind = _field_type(field)
    try:
        number = kind(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or (kind is float and not math.isfinite(number)):
        raise ValueError(f"{family} {field.name} = {value!r} is not {'an integer' if kind is int else 'a finite number'}")
    if number < 0:
        raise ValueError(f"{family} {field.name} = {value!r} must not be negative")
    return number


def apply_shape(family: ModelSpec, cfg: ModelConfig, overrides: Mapping[str, Any]) -> ModelConfig:
    """`cfg` with `overrides` (field -> value, as text or number) applied; ValueError naming the
    field and the fix when a name is not a field of the family's config, a value is not of its
    type, or the result breaks one of the family's shape rules."""
    if not overrides:
        return cfg
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    values = {}
    for name, value in overrides.items():
        if name not in fields:
            raise ValueError(f"{family.name} has no dimension {name!r}; its config's fields are: {', '.join(fields)}")
        if name in ATTENTION_FIELDS:
            raise ValueError(f"--shape {name}: the attention is chosen with --{name.replace('_', '-')}, not as a dimension")
        if name == "etp":
            raise ValueError("--shape etp: expert tensor parallelism is chosen with --etp, not as a dimension")
        values[name] = _convert(family.name, fields[name], value)
    shaped = dataclasses.replace(cfg, **values)
    family.check_shape(shaped)
    return shaped


def shape_tags(overrides: Mapping[str, Any]) -> list[str]:
    """The artifact name's tags for a custom shape, e.g. ['dim512', 'vocab_size32000'], in field
    name order (so the same overrides always give the same name)."""
    return [f"{name}{value:g}" if isinstance(value, float) else f"{name}{value}"
            for name, value in sorted(overrides.items())]


def require_positive(cfg: ModelConfig, names: Iterable[str]) -> None:
    """Raise ValueError unless each named field of `cfg` is at least 1."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be at least 1 (got {getattr(cfg, name)})")

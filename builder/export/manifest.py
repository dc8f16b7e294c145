"""The manifest a build writes (artifacts/README.md), and whether a build may replace the
artifact already at its --out."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from titan.builder.spec.cache_key import build_factors
from titan.runtime.common.environment import installed_torch_version
from titan.runtime.contract.hf_record import RECORD
from titan.runtime.contract.manifest import ARTIFACT_FORMAT, MANIFEST, format_version

if TYPE_CHECKING:
    from titan.builder.spec.build_spec import BuildSpec

# Manifest fields that shape the graphs: an artifact directory is replaced only by a build
# that agrees on all of them (or with --replace).
SHAPING_FIELDS = ("model", "flavor", "layout", "batch_size", "seq_len", "dtype", "ac", "passes", "moe_capacity")


def _hf_record(spec: BuildSpec) -> dict | None:
    family = spec.model_spec
    if family.hf_checkpoint is None:
        return None
    return family.hf_checkpoint(spec.cfg, list(family.init_specs(spec.cfg))).to_json()


def manifest_fields(spec: BuildSpec, factors: dict) -> dict:
    # A bounded MoE artifact, or one whose programs take parameter copies, is a format an older
    # runtime must refuse (runtime/contract/manifest.py: format_version).
    capacity = {} if spec.moe_capacity is None else {
        "moe_capacity": {"factor": spec.moe_capacity, "drop": spec.moe_drop}}
    return {
        "format": ARTIFACT_FORMAT,
        "format_version": format_version(passes=list(spec.passes), dtype=factors["dtype"],
                                         moe_capacity=spec.moe_capacity),
        "model": spec.model,
        "flavor": spec.flavor,
        "model_config": spec.cfg.as_dict(),
        "layout": spec.layout.as_dict(),
        "mesh": [list(d) for d in spec.layout.mesh_shape()],
        "world_size": spec.layout.world_size,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "dtype": factors["dtype"],
        "ac": factors["activation checkpointing"],
        "param_dtype": "float32",
        "torch_version": installed_torch_version(),
        "builder_version": factors["builder version"],
        "passes": list(spec.passes),
        # What the runtime needs of the model to read and write its Hugging Face checkpoints.
        RECORD: _hf_record(spec),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **capacity,
    }


def check_replaceable(spec: BuildSpec, out: Path) -> None:
    """Refuse to replace an artifact of another build (other shapes, dtype, passes, ...):
    ValueError naming each difference. A rebuild of the same choices replaces it."""
    try:
        old = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        old = {}
    old = old if isinstance(old, dict) else {}
    new = manifest_fields(spec, build_factors(spec))
    diffs = [f"{k.replace('_', ' ')} {old.get(k)!r} there, {new.get(k)!r} now" for k in SHAPING_FIELDS
             if old.get(k) != new.get(k)]
    if diffs:
        raise ValueError(f"{out} holds another build ({'; '.join(diffs)}); pass --replace to replace it, "
                         "or --out DIR to write this one elsewhere")

"""The cache key: every factor that changes a build's output, named, computed in one place.

No torch import here: the cache-hit path of titan-build must stay well under two seconds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import titan.builder
import titan.runtime
from titan.runtime.common.environment import installed_torch_version, torch_release

SOURCE_ROOTS = {"builder": Path(titan.builder.__file__).parent, "runtime": Path(titan.runtime.__file__).parent}
"""The packages whose source makes the builder version (their folders wherever installed)."""


def versioned_sources() -> list[tuple[str, Path]]:
    """(name, path) of each source file whose bytes make the builder version: all of builder/
    and runtime/, each named from its package down (builder/passes/regions.py)."""
    return [(f"{pkg}/{path.relative_to(root).as_posix()}", path)
            for pkg, root in sorted(SOURCE_ROOTS.items()) for path in sorted(root.rglob("*.py"))]


def builder_version() -> str:
    """Hash of the builder's and runtime's own source: any code change makes a new version."""
    h = hashlib.sha256()
    for name, path in versioned_sources():
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build_factors(spec) -> dict:
    """Factor name -> value for a BuildSpec. Names are what --explain prints. A MoE capacity and
    a pipeline's choices are factors only where they are set: other builds keep the keys they
    always had."""
    capacity = {} if spec.moe_capacity is None else {
        "moe capacity": {"factor": spec.moe_capacity, "overflow": "drop" if spec.moe_drop else "redo dropless"}}
    pipeline = {"pipeline": spec.pipeline.factor()} if spec.pipeline else {}
    stage = {"pipeline stage": spec.stage.place_json()} if spec.stage else {}
    return pipeline | stage | capacity | {
        "model": spec.model,
        "flavor": spec.flavor,
        "model config": spec.cfg.as_dict(),
        "mesh": [[name, size] for name, size in spec.layout.mesh_shape()],
        "batch size": spec.batch_size,
        "seq len": spec.seq_len,
        "passes": list(spec.passes),
        "dtype": spec.dtype,
        "activation checkpointing": spec.ac,
        "torch version": torch_release(installed_torch_version()),
        "builder version": builder_version(),
        # Graphs are device-agnostic today (attention dispatches at run time); kernel-generating
        # passes will make this the GPU architecture.
        "target device": "any",
    }


def rank_factors(build: dict, coords: dict[str, int], *, depth: int | None = None) -> dict:
    """A traced rank's factors; `depth` when it was traced with fewer layers than the flavor's."""
    return dict(build, **{"rank coordinates": coords}, **({} if depth is None else {"traced depth": depth}))


def digest(factors: dict) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:32]


def describe_differences(old: dict, new: dict) -> list[str]:
    """Human-readable factor changes from `old` to `new`, e.g. 'torch version 2.11.0 -> 2.13.0'."""
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list) and name == "passes":
            changes = [f"+{p}" for p in b if p not in a] + [f"-{p}" for p in a if p not in b]
            out.append(f"{name} {' '.join(changes) or f'{a} -> {b}'}")
        elif isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    out.append(f"{name} {sub} {a.get(sub)} -> {b.get(sub)}")
        else:
            out.append(f"{name} {_short(a)} -> {_short(b)}")
    return out


def _short(v) -> str:
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)

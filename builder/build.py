"""titan-build's pipeline: spec (builder/spec) -> cache lookup -> trace the probe ranks in
processes forked from one that imported the tracer (builder/trace) -> one program with rank
bindings, a deep model's fitted from shallow traces (builder/program) -> store in the cache ->
export the artifact (builder/export).

Nothing on the cache-hit path imports torch, and this process never imports the tracer (the
trace processes do)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from titan.builder.trace import rank_progress
from titan.builder.spec.build_spec import BuildSpec
from titan.runtime.store.build_cache import Cache
from titan.builder.spec.cache_key import build_factors, describe_differences, digest
from titan.builder.export.artifact import export_artifact
from titan.builder.export.manifest import manifest_fields
from titan.builder.program.programs import make_programs
from titan.builder.trace.cached import CachedTracer
from titan.runtime.common import interrupt
from titan.runtime.contract.manifest import Manifest


@dataclass(kw_only=True)
class BuildOutcome:
    manifest: Manifest
    """The exported artifact's manifest."""
    key: str
    """Cache key of the build."""
    hit: bool
    """True when the cache already held the build (nothing was traced)."""
    reason: str
    """Why it missed ('' on a hit)."""
    traced: list[int]
    """Ranks traced by this call."""
    traces: int = 0
    """Traces made by this call (a rank may be traced at several depths: builder/program/stamp.py)."""
    note: str = ""
    """How the build deviated from one program fitted from shallow traces (empty when it did
    not, or on a hit)."""
    redo: dict = field(default_factory=dict)
    """A bounded MoE build's dropless redo programs (`redo_programs`, `redo_rank_programs`), as
    the artifact was exported with them; empty otherwise."""


def _store_program(cache: Cache, program) -> dict:
    """A program's blobs; its metadata names its graphs, so a manifest that pairs them
    otherwise is refused at load."""
    fw, bw = cache.put_blob(program.forward), cache.put_blob(program.backward)
    meta = replace(program.meta, forward_graph=fw, backward_graph=bw).to_json()
    return {"forward": fw, "backward": bw, "meta": cache.put_blob(json.dumps(meta, indent=1).encode()),
            "bindings": program.bindings}


def nearest_entry(cache: Cache, factors: dict) -> tuple[str, list[str]] | None:
    """The cached build of the same model whose factors differ least, and how they differ."""
    best = None
    for info in cache.entries():
        other = info.entry.get("factors", {})
        if other.get("model") != factors["model"]:
            continue
        diff = describe_differences(other, factors)
        if best is None or len(diff) < len(best[1]):
            best = (info.key, diff)
    return best


def build(spec: BuildSpec, out: Path, *, cache: Cache, jobs: int, progress=lambda res: None,
          on_wait=None, on_give_up=None, on_miss=lambda reason: None,
          on_stage: Callable[[int, str], None] = lambda rank, stage: None) -> BuildOutcome:
    """Build through the cache: a hit traces nothing; a miss traces the probe ranks the cache
    lacks (a killed build's finished ranks are reused) and makes one program of them (or, when
    ranks truly differ, traces every rank: one program per class). One build per key at a
    time. `on_stage(rank, stage)` follows each traced rank through rank_progress.STAGES.

    A bounded MoE build that redoes overflowing steps (`spec.moe_redo`) is two cache entries:
    the dropless build (the default build's own key, shared with it) and the bounded one; the
    artifact carries the dropless programs as its redo programs."""
    kw = dict(cache=cache, jobs=jobs, progress=progress, on_wait=on_wait, on_give_up=on_give_up, on_miss=on_miss,
              on_stage=on_stage)
    if spec.pipeline is not None:
        return _pipeline_build(spec, out, **kw)
    redo = None
    if spec.moe_redo:
        said = dict(on_miss=lambda why: on_miss(f"the dropless program it carries: {why}"))
        redo = _cached_entry(spec.dropless(), **(kw | said))
    main = _cached_entry(spec, **kw)
    redo_fields = {} if redo is None else {"redo_programs": redo.entry["programs"],
                                           "redo_rank_programs": redo.entry["rank_programs"]}
    manifest = export_artifact(cache, dict(main.entry, **redo_fields), out)
    parts = [main] if redo is None else [redo, main]
    reason = "; ".join(p.reason for p in parts if p.reason)
    return BuildOutcome(manifest=manifest, key=main.key, hit=not reason, reason=reason,
                        traced=sorted({r for p in parts for r in p.traced}), traces=sum(p.traces for p in parts),
                        note="; ".join(p.entry.get("note", "") for p in parts if p.reason and p.entry.get("note")),
                        redo=redo_fields)


def _pipeline_build(spec: BuildSpec, out: Path, *, on_miss, **kw) -> BuildOutcome:
    """A pipeline build: each stage is a build of its own (traced, or found, in the cache), put
    together with the schedule (builder/program/stage_programs.py). A bounded MoE dispatch that
    redoes overflows (`spec.moe_redo`) carries each stage's dropless build beside its bounded one
    (the dropless pipeline's stages: the same cache entries)."""
    from titan.builder.program.stage_programs import pipeline_entry

    parts, notes = _stage_parts(spec, on_miss=on_miss, **kw)
    redo = []
    if spec.moe_redo:
        redo, redo_notes = _stage_parts(spec.dropless(), **kw,
                                        on_miss=lambda why: on_miss(f"the dropless programs it carries: {why}"))
        notes += [f"dropless: {n}" for n in redo_notes]
    factors = build_factors(spec)
    key = digest(factors)
    entry = pipeline_entry(spec, [p.entry for p in parts], cache=kw["cache"], key=key,
                           manifest=manifest_fields(spec, factors), redo_entries=[p.entry for p in redo])
    manifest = export_artifact(kw["cache"], entry, out)
    record = spec.pipeline.schedule_record()
    per_stage = spec.layout.world_size // spec.layout.pp
    both = parts + redo
    reason = "; ".join(f"stage {i % len(parts)}{' (dropless)' if i >= len(parts) else ''}: {p.reason}"
                       for i, p in enumerate(both) if p.reason)
    return BuildOutcome(manifest=manifest, key=key, hit=not reason, reason=reason,
                        traced=sorted({record.stage_rank[i % len(parts)] * per_stage + r for i, p in enumerate(both)
                                       for r in p.traced}),
                        traces=sum(p.traces for p in both), note="; ".join(notes) if reason else "")


def _stage_parts(spec: BuildSpec, *, on_miss, on_stage: Callable[[int, str], None],
                 **kw) -> tuple[list[_Cached], list[str]]:
    """Each stage's cache entry, in stage order, and how they were made. A run of middle stages
    of the same size is traced at its ends, and the stages between get the first's programs
    relabeled (builder/program/stage_relabel.py) when that reproduces the last's trace exactly.
    A rank the progress lines name is a global rank: the stage's pp rank's block + its rank in
    the block."""
    record = spec.pipeline.schedule_record()
    per_stage = spec.layout.world_size // spec.layout.pp
    stage_specs = spec.stage_builds()
    parts: dict[int, _Cached] = {}
    missed: list[str] = []

    def first_miss(stage: int, why: str) -> None:  # one "miss" line for the build, not one per stage
        if not missed:
            on_miss(f"stage {stage}: {why}")
        missed.append(why)

    def cached(s: int) -> _Cached:
        if s not in parts:
            block = record.stage_rank[s] * per_stage  # a stage's ranks are named by their global rank
            said = dict(on_miss=lambda why: first_miss(s, why),
                        on_stage=lambda rank, name: on_stage(block + rank, name),
                        progress=lambda res: kw["progress"](replace(res, rank=block + res.rank)))
            parts[s] = _cached_entry(stage_specs[s], **(kw | said))
        return parts[s]

    notes = []
    for run in _middle_runs(stage_specs):
        first, last = cached(run[0]), cached(run[-1])
        # Checked only when a stage between lacks its entry (a rebuild from the cache reads no graph).
        between_cached = all(kw["cache"].entry_record(digest(build_factors(stage_specs[s]))) for s in run[1:-1])
        if between_cached or _relabels(kw["cache"], stage_specs[run[0]], first, stage_specs[run[-1]], last):
            for s in run[1:-1]:
                parts[s] = _relabeled_entry(stage_specs[s], stage_specs[run[0]], first, cache=kw["cache"],
                                            on_wait=kw["on_wait"], on_give_up=kw["on_give_up"])
            if not between_cached:
                between = f"stage {run[1]}" if len(run) == 3 else f"stages {run[1]}-{run[-2]}"
                notes.append(f"{between} relabeled from stage {run[0]} (checked against stage {run[-1]})")
        else:
            notes.append(f"stages {run[0]}-{run[-1]} traced one by one (stage {run[0]} relabeled is not stage "
                         f"{run[-1]}'s trace)")
    return [cached(s) for s in range(len(stage_specs))], notes


def _middle_runs(stage_specs: list[BuildSpec]) -> list[list[int]]:
    """Runs of at least three consecutive middle stages (neither first nor last) of one size."""
    runs: list[list[int]] = []
    for s, stage_spec in enumerate(stage_specs):
        stage = stage_spec.stage
        if stage.first or stage.last:
            continue
        size = stage.layers[1] - stage.layers[0]
        prev = runs[-1] if runs else None
        if prev and prev[-1] == s - 1 and stage_specs[prev[0]].stage.layers[1] - stage_specs[prev[0]].stage.layers[0] == size:
            prev.append(s)
        else:
            runs.append([s])
    return [run for run in runs if len(run) >= 3]


def _relabels(cache: Cache, source_spec: BuildSpec, source: _Cached, target_spec: BuildSpec, target: _Cached) -> bool:
    from titan.builder.program.stage_relabel import relabels_exactly
    return relabels_exactly(cache, source.entry["programs"], target.entry["programs"],
                            shift=target_spec.stage.layers[0] - source_spec.stage.layers[0], stage=target_spec.stage,
                            init_specs=target_spec.model_spec.init_specs(target_spec.cfg))


def _relabeled_entry(spec: BuildSpec, source_spec: BuildSpec, source: _Cached, *, cache: Cache, on_wait,
                     on_give_up) -> _Cached:
    """The cache entry of stage `spec`: found, or made from `source`'s programs relabeled."""
    from titan.builder.program.stage_relabel import relabeled_programs

    factors = build_factors(spec)
    key = digest(factors)
    lock = cache.lock(key, on_wait=on_wait, on_give_up=on_give_up)
    try:
        entry, reason = cache.get_entry(key)
        if entry is None:
            shift = spec.stage.layers[0] - source_spec.stage.layers[0]
            programs = relabeled_programs(cache, source.entry["programs"], shift=shift, stage=spec.stage,
                                          init_specs=spec.model_spec.init_specs(spec.cfg))
            entry = {"key": key, "factors": factors, "ranks": [], "programs": programs,
                     "rank_programs": source.entry["rank_programs"], "traced_ranks": [], "traces": 0,
                     "note": f"the programs of pipeline stage {source_spec.stage.index} with block names shifted by "
                             f"{shift}", "manifest": manifest_fields(spec, factors), "created_ts": time.time()}
            with interrupt.deferred():
                cache.put_entry(key, entry)
        cache.touch(key)
    finally:
        lock.release()
    return _Cached(key=key, entry=entry, reason=reason, traced=[], traces=0)


@dataclass(kw_only=True)
class _Cached:
    """One cache entry as build() found or made it."""
    key: str
    entry: dict
    reason: str
    traced: list[int]
    traces: int


def _cached_entry(spec: BuildSpec, *, cache: Cache, jobs: int, progress, on_wait, on_give_up, on_miss,
                  on_stage: Callable[[int, str], None]) -> _Cached:
    """The cache entry of `spec`: found, or traced and stored (under its key's lock)."""
    reached: dict[int, int] = {}

    def stage(rank: int, name: str) -> None:
        # Reports from the trace processes can arrive after their result: never step back.
        index = rank_progress.STAGES.index(name)
        if index > reached.get(rank, -1):
            reached[rank] = index
            on_stage(rank, name)

    factors = build_factors(spec)
    key = digest(factors)
    lock = cache.lock(key, on_wait=on_wait, on_give_up=on_give_up)
    try:
        entry, reason = cache.get_entry(key)
        traced: list[int] = []
        traces = 0
        if entry is None:
            on_miss(reason)
            tracer = CachedTracer(spec, cache, factors, jobs, stage, progress)
            programs, assignment, note = make_programs(tracer, spec)
            traced_ranks = sorted({r for r, _ in tracer.traces})
            entry = {"key": key, "factors": factors,
                     # The traced ranks' records: a rebuild after a lost entry reuses them.
                     "ranks": [tracer.keys[t] for t in sorted(tracer.traces, key=_trace_order)],
                     "programs": [_store_program(cache, p) for p in programs], "rank_programs": assignment,
                     "traced_ranks": traced_ranks, "traces": len(tracer.traces), "note": note,
                     "manifest": manifest_fields(spec, factors), "created_ts": time.time()}
            with interrupt.deferred():
                cache.put_entry(key, entry)
            traced = sorted({r for r, _ in tracer.traced})
            traces = len(tracer.traced)
        cache.touch(key)
    finally:
        lock.release()
    return _Cached(key=key, entry=entry, reason=reason, traced=traced, traces=traces)


def _trace_order(key: tuple[int, int | None]) -> tuple[int, int]:
    rank, depth = key
    return rank, -1 if depth is None else depth

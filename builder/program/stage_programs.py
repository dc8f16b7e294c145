"""A pipeline build's programs: each stage is traced and cached as a build of its own
(BuildSpec.stage_builds: one program with bindings per stage, on the layout without pp), and the
artifact puts them together: every stage's programs in one list, the program of each stage on
each rank of the stage's block, the schedule every pp rank runs (docs/pipeline.md), and the
compiled kernels each stage's entry records (titan-build --kernels)."""

from __future__ import annotations

import json

from titan.builder.spec.build_spec import BuildSpec
from titan.runtime.store.build_cache import Cache
from titan.runtime.contract.rank_record import StageIO


def pipeline_entry(spec: BuildSpec, stage_entries: list[dict], *, cache: Cache, key: str, manifest: dict,
                   redo_entries: list[dict] = ()) -> dict:
    """The artifact entry (as builder/export/artifact.py exports it) of a pipeline build from its
    stages' cache entries, in stage order; `manifest`: the pipeline build's manifest fields;
    `redo_entries`: with a bounded MoE dispatch that redoes overflows, each stage's dropless
    build's entry (its redo programs)."""
    programs, stage_programs, rank_programs = _stage_tables(spec, stage_entries, cache)
    pipeline = {"schedule": spec.pipeline.schedule_record().to_json(), "stage_programs": stage_programs}
    redo = {}
    if redo_entries:
        redo_programs, pipeline["redo_stage_programs"], redo_rank_programs = _stage_tables(spec, redo_entries, cache)
        redo = {"redo_programs": redo_programs, "redo_rank_programs": redo_rank_programs}
    # Stages of one size share regions: one key, one kernel.
    kernels = {k: sha for entry in stage_entries for k, sha in entry.get("kernels", {}).items()}
    return {"key": key, "programs": programs, "rank_programs": rank_programs, "kernels": kernels, **redo,
            "manifest": dict(manifest, pipeline=pipeline)}


def _stage_tables(spec: BuildSpec, stage_entries: list[dict], cache: Cache) -> tuple[list[dict], list[list[int]], list[int]]:
    """Every stage's programs in one list, the index of each stage's program on each place of its
    block of ranks, and each rank's first stage's program."""
    layout = spec.layout
    per_stage = layout.world_size // layout.pp
    schedule = spec.pipeline.schedule_record()
    programs: list[dict] = []
    stage_programs = []
    for entry in stage_entries:
        offset = len(programs)
        programs += entry["programs"]
        stage_programs.append([offset + entry["rank_programs"][place] for place in range(per_stage)])
    _check_neighbours([_stage_io(cache, entry) for entry in stage_entries])
    rank_programs = [stage_programs[schedule.stage_rank.index(layout.coordinates(rank)["pp"])][rank % per_stage]
                     for rank in range(layout.world_size)]
    return programs, stage_programs, rank_programs


def pipeline_artifact_entry(spec: BuildSpec, *, cache: Cache) -> dict:
    """pipeline_entry of a build whose stages are all in the cache (titan-build --kernels
    exports it again once it has recorded the stages' kernels)."""
    from titan.builder.export.manifest import manifest_fields
    from titan.builder.spec.cache_key import build_factors, digest

    def entries(of: BuildSpec) -> list[dict]:
        found = []
        for stage in of.stage_builds():
            entry, why = cache.get_entry(digest(build_factors(stage)))
            if entry is None:
                raise ValueError(f"the cache entry of pipeline stage {stage.stage.index} is gone ({why}); build again")
            found.append(entry)
        return found

    factors = build_factors(spec)
    return pipeline_entry(spec, entries(spec), cache=cache, key=digest(factors), manifest=manifest_fields(spec, factors),
                          redo_entries=entries(spec.dropless()) if spec.moe_redo else [])


def _stage_io(cache: Cache, entry: dict) -> StageIO:
    """What a stage's first program says it receives and sends (its programs agree: they are one
    stage's, told apart only by bindings or rank classes)."""
    meta = json.loads(cache.read_blob(entry["programs"][0]["meta"]))
    return StageIO.from_json(meta["stage"], "stage program")


def _check_neighbours(stages: list[StageIO]) -> None:
    """What each stage sends is what the next one receives: the receive buffers are made from the
    receiving stage's record."""
    for sender, receiver in zip(stages, stages[1:]):
        if (sender.output_shape, sender.dtype) != (receiver.input_shape, receiver.dtype):
            raise AssertionError(f"stage {sender.index} sends {sender.dtype} {list(sender.output_shape)} but stage "
                                 f"{receiver.index} receives {receiver.dtype} {list(receiver.input_shape)}")

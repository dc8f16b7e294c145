"""A build's pipeline choices (--pp's schedule, micro-batches and stage split), checked against the
model and the rest of the layout before anything is traced; ValueError names the fix."""

from __future__ import annotations

from dataclasses import dataclass

from titan.builder.spec.pipeline_order import interleaved_rounds, pipeline_schedule
from titan.builder.models import MODELS
from titan.builder.spec.stage_split import balanced_split, layer_spans, parse_split
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.pipeline_schedule import (MAX_ACTIONS, MAX_MICROBATCHES, SCHEDULES, SPLIT_BACKWARD,
                                                      PipelineSchedule)
from titan.runtime.contract.rank_record import StagePlace

PIPELINE_MODELS = tuple(name for name, family in MODELS.items() if family.stage_costs is not None)
"""Families whose stage split and stage programs titan knows (a stage cost model each)."""


@dataclass(kw_only=True, frozen=True)
class PipelineSpec:
    schedule: str
    """gpipe, 1f1b, interleaved-1f1b or zbv (--pp-schedule)."""
    stages_per_rank: int = 1
    """Stages per pp rank (--pp-stages-per-rank; above 1 with interleaved-1f1b, exactly 2 with zbv)."""
    microbatches: int
    """Micro-batches per step, each of the build's --batch-size sequences (--microbatches)."""
    stage_layers: tuple[int, ...]
    """Transformer blocks per stage, first stage first (balanced by cost, or --pp-split)."""
    split_given: bool
    """Whether the user gave the split (--pp-split); else it is the balanced one."""

    def schedule_record(self) -> PipelineSchedule:
        return pipeline_schedule(self.schedule, spans=layer_spans(self.stage_layers), microbatches=self.microbatches,
                                 stages_per_rank=self.stages_per_rank)

    def stages(self) -> list[StagePlace]:
        """Each stage's place: a pipeline build traces each as a build of its own
        (BuildSpec.stage_builds)."""
        spans = layer_spans(self.stage_layers)
        return [StagePlace(index=s, stages=len(spans), layers=span) for s, span in enumerate(spans)]

    def tags(self) -> list[str]:
        """Artifact-name parts: `1f1b-mb4` (`interleaved-1f1b-v2-mb4`), and `split-3-1` for a split
        given by hand."""
        v = f"-v{self.stages_per_rank}" if self.schedule == "interleaved-1f1b" else ""  # zbv's 2 go unsaid
        return [f"{self.schedule}{v}-mb{self.microbatches}",
                *(["split-" + "-".join(map(str, self.stage_layers))] if self.split_given else [])]

    def factor(self) -> dict:
        """The cache-key factor (builds without a pipeline have none, so their keys are unchanged)."""
        return {"schedule": self.schedule, "microbatches": self.microbatches, "stage layers": list(self.stage_layers),
                **({"stages per rank": self.stages_per_rank} if self.stages_per_rank > 1 else {})}


def make_pipeline(*, model: str, cfg, layout: Layout, seq_len: int, schedule: str | None, microbatches: int | None,
                  split: str | None, stages_per_rank: int | None = None) -> PipelineSpec | None:
    """The pipeline of a build with --pp > 1 (None with --pp 1, which takes no pipeline option)."""
    if layout.pp == 1:
        given = [flag for flag, value in (("--pp-schedule", schedule), ("--microbatches", microbatches),
                                          ("--pp-split", split), ("--pp-stages-per-rank", stages_per_rank))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} set without --pp; add --pp N (N > 1) or drop {given[0]}")
        return None
    if model not in PIPELINE_MODELS:
        raise ValueError(f"--pp {layout.pp}: pipeline stages are built for {', '.join(PIPELINE_MODELS)} so far; "
                         f"build {model} with --pp 1")
    schedule = schedule or "1f1b"
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown --pp-schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    interleaved = schedule == "interleaved-1f1b"
    v = (2 if schedule in ("interleaved-1f1b", "zbv") else 1) if stages_per_rank is None else stages_per_rank
    if interleaved and v < 2:
        raise ValueError("--pp-schedule interleaved-1f1b needs --pp-stages-per-rank >= 2; raise it or use 1f1b")
    if schedule == "zbv" and v != 2:
        raise ValueError(f"--pp-schedule zbv places exactly 2 stages on each rank (rank r holds stages r and "
                         f"2 pp - 1 - r, a V), not {v}; drop --pp-stages-per-rank or use interleaved-1f1b")
    if schedule not in ("interleaved-1f1b", "zbv") and v > 1:
        raise ValueError(f"--pp-stages-per-rank {v} needs --pp-schedule interleaved-1f1b; add it or drop "
                         "--pp-stages-per-rank")
    stages = layout.pp * v
    if stages > cfg.n_layers:
        per_rank = f" x --pp-stages-per-rank {v}" if v > 1 else ""
        raise ValueError(f"--pp {layout.pp}{per_rank} needs at least {stages} layers (one per stage); the model has "
                         f"{cfg.n_layers}: use fewer stages or more --n-layers")
    microbatches = layout.pp if microbatches is None else microbatches
    if not 1 <= microbatches <= MAX_MICROBATCHES:
        raise ValueError(f"--microbatches must be in [1, {MAX_MICROBATCHES}], got {microbatches}")
    if schedule == "1f1b" and microbatches < layout.pp:
        raise ValueError(f"--pp-schedule 1f1b needs --microbatches >= --pp ({microbatches} < {layout.pp}): its "
                         "warm-up fills every stage; raise --microbatches or use --pp-schedule gpipe")
    rounds, _ = interleaved_rounds(layout.pp, microbatches)
    if interleaved and microbatches % rounds:
        raise ValueError(f"--pp-schedule interleaved-1f1b runs micro-batches in rounds of about --pp: --microbatches "
                         f"{microbatches} is not a multiple of its {rounds} rounds; use a multiple of --pp")
    # At most: forward, backward (I and W when split) and four transfers per stage and micro-batch.
    actions = (7 if schedule in SPLIT_BACKWARD else 6) * stages * microbatches
    if actions > MAX_ACTIONS:
        raise ValueError(f"{stages} stages x --microbatches {microbatches} is up to {actions:,} actions per step, "
                         f"more than a schedule record holds ({MAX_ACTIONS:,}); use fewer micro-batches")
    if split is None:
        counts = balanced_split(MODELS[model].stage_costs(cfg, seq_len), stages)
    else:
        counts = parse_split(split, stages=stages, n_layers=cfg.n_layers)
    return PipelineSpec(schedule=schedule, stages_per_rank=v, microbatches=microbatches, stage_layers=counts,
                        split_given=split is not None)

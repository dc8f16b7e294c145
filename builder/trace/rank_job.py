"""A trace process: what it is given and gives back, and how it starts (builder/trace/rank_trace.py does
the tracing). Kept apart from the tracer, so that titan-build's own process hands out jobs
without importing it."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from titan.builder.trace import rank_progress
from titan.runtime.contract.rank_record import RankRecord


@dataclass(kw_only=True, frozen=True)
class RankJob:
    build: object
    """What is built (builder/spec/build_spec.py BuildSpec): model, layout, batch shape, partitioner,
    dtype, AC policy, passes."""
    rank: int
    """Rank to trace."""
    depths: tuple[int | None, ...] = (None,)
    """Trace the model at each of these depths (None: the flavor's own; builder/program/stamp.py
    fits deep programs from shallow ones), one after the other in this process."""


@dataclass(kw_only=True)
class RankResult:
    rank: int
    depth: int | None
    """The depth traced (None: the flavor's own)."""
    forward: bytes
    backward: bytes
    meta: RankRecord
    timings: dict = field(default_factory=dict)


def trace_job(job: RankJob) -> list[RankResult]:
    """A trace process's task (the tracer is already imported there: builder/trace/preload.py)."""
    from titan.builder.trace.rank_trace import trace_rank

    # The objects the fork server made (torch and the tracer: millions, alive as long as this
    # process) out of the cyclic collector's way: its collections traversed them all, ~15% of a
    # trace's time.
    gc.freeze()
    return trace_rank(job)


def start_trace_process(stages) -> None:
    """Pool initializer of a trace process: report its stages into `stages`. (It already dies
    with the fork server that forked it: builder/trace/preload.py.)"""
    rank_progress.attach(stages)

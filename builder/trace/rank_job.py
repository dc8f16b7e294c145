"""A trace process: how it starts and runs its job (builder/trace/job.py says what a job is;
builder/trace/rank_trace.py does the tracing). Kept apart from the tracer, so that
titan-build's own process hands out jobs without importing it."""

from __future__ import annotations

import gc
from titan.builder.trace import rank_progress
from titan.builder.trace.job import RankJob, RankResult


def trace_job(job: RankJob) -> list[RankResult]:
    """A trace process's task (the tracer is already imported there: builder/trace/preload.py)."""
    from titan.builder.trace.rank_trace import trace_rank

    # The objects the fork server made (torch and the tracer: millions, alive as long as this
    # process) out of the cyclic collector's way: its collections traversed them all, ~15% of a
    # trace's time.
    gc.freeze()
    # And no cyclic collection at all: a trace makes millions of objects, most alive to its end,
    # so the collector's passes over them found little (about +6% resident, -5-10% CPU for a
    # DeepSeek-V3 671B trace, issue 30); the process ends after its job and frees everything.
    gc.disable()
    return trace_rank(job)


def start_trace_process(stages) -> None:
    """Pool initializer of a trace process: report its stages into `stages`. (It already dies
    with the fork server that forked it: builder/trace/preload.py.)"""
    rank_progress.attach(stages)

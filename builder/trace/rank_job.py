"""A trace process: what it is given and gives back, and how it starts (builder/trace/rank_trace.py does
the tracing). Kept apart from the tracer, so that titan-build's own process hands out jobs
without importing it."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
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


def start_trace_process(stages, build_pid: int) -> None:
    """Pool initializer of a trace process: report its stages into `stages`, and die with the
    fork server that forked it, so that a Ctrl-C which stops the server while it forks leaves
    no orphan behind (an orphan is nobody's descendant: the build could not find it)."""
    _die_with_parent(build_pid)
    rank_progress.attach(stages)


def _die_with_parent(build_pid: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    # The server may have died before that call: this process is then no longer its child.
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        grandparent = -1
    if grandparent != build_pid:
        os._exit(1)

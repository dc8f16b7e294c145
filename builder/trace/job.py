"""What a trace process is given (RankJob) and gives back (RankResult): plain data, so that
titan-build's own process, the process pool and the tracer share it without importing each
other."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(kw_only=True)
class Trace:
    """One traced rank: its graph blobs and rank metadata (rank_trace.py), as the program stage
    (builder/program) takes it."""

    rank: int
    forward: bytes
    backward: bytes
    meta: RankRecord

"""Per-rank build stages, reported from the trace processes to titan-build.

Each trace process gets the build's queue when it starts (pool.py's initializer);
rank_trace.py reports `(rank, stage)` into it. Without a queue (a rank traced in-process) reporting
does nothing.
"""

from __future__ import annotations

STAGES = ("queued", "tracing", "partitioning", "writing", "done", "cache hit")

_queue = None


def attach(queue) -> None:
    """Pool initializer: report this process's stages into `queue`."""
    global _queue
    _queue = queue


def report(rank: int, stage: str) -> None:
    assert stage in STAGES, stage
    if _queue is not None:
        _queue.put((rank, stage))

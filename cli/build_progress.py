"""titan-build's per-rank progress: one status line on a terminal, plain lines otherwise.

Stages (builder/trace/rank_progress.py): queued, tracing, partitioning, writing, done, or cache hit.
Plain form: `  rank R: STAGE` per change; a traced rank's `done` line is its summary,
`  rank R: done: traced in ... s, partitioned in ... s, passes ... s; memory: ...`.
Terminal form: `ranks [####----] 2/4 | done 0 1 | tracing 2 | queued 3 | 0:12`, redrawn in
place; the per-rank summaries are printed above it, and it is left on screen at the end.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from titan.builder.trace.rank_progress import STAGES
from titan.runtime.common.progress import StatusLine, bar, duration, is_terminal


def _ranks(ranks: list[int]) -> str:
    """0 1 2 5 -> '0-2 5'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return " ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else " ".join(map(str, run)) for run in runs)


class BuildProgress:
    """Receives build() stage reports; on a terminal a thread also redraws the line every
    second, so the clock moves while a rank traces."""

    def __init__(self, world_size: int, stream: TextIO = sys.stdout):
        self.world_size = world_size
        self.stream = stream
        self.status = StatusLine(stream) if is_terminal(stream) else None
        self.stages: dict[int, str] = {}
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.ticker = None

    def stage(self, rank: int, stage: str) -> None:
        with self.lock:
            self.stages[rank] = stage
            if self.status is None:
                if stage != "done":  # a traced rank's summary line says it
                    print(f"  rank {rank}: {stage}", file=self.stream, flush=True)
                return
            self.status.update(self.line())
            if self.ticker is None:
                self.ticker = threading.Thread(target=self._tick, daemon=True)
                self.ticker.start()

    def _tick(self) -> None:
        while not self.stopped.wait(1.0):
            with self.lock:
                if not self.stopped.is_set():
                    self.status.update(self.line())

    def rank_done(self, text: str) -> None:
        """A traced rank's summary line."""
        with self.lock:
            if self.status is None:
                print(text, file=self.stream, flush=True)
                return
            self.status.print_above(text)
            self.status.update(self.line())

    def line(self) -> str:
        finished = sum(1 for s in self.stages.values() if s in ("done", "cache hit"))
        parts = [f"ranks {bar(finished, self.world_size)} {finished}/{self.world_size}"]
        for stage in reversed(STAGES):
            ranks = [r for r, s in self.stages.items() if s == stage]
            if ranks:
                parts.append(f"{stage} {_ranks(ranks)}")
        parts.append(duration(time.monotonic() - self.t0))
        return " | ".join(parts)

    def finish(self) -> None:
        """Stop redrawing; leave the last status line on screen (only if one was drawn)."""
        self.stopped.set()
        if self.ticker is not None:
            self.ticker.join()
        with self.lock:
            if self.status is not None:
                self.status.finish()

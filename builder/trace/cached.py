"""Tracing through the build cache: a traced rank is stored as soon as it finishes, so that a
killed build resumes without tracing it again, and a rank the cache holds is not traced."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from titan.runtime.store.build_cache import Cache
from titan.builder.spec.cache_key import digest, rank_factors
from titan.builder.trace.job import Trace
from titan.builder.trace.pool import trace_in_processes, trace_tasks
from titan.runtime.common import interrupt
from titan.runtime.contract.rank_record import RankRecord

if TYPE_CHECKING:
    from titan.builder.spec.build_spec import BuildSpec


def _store_rank(cache: Cache, rank_key: str, factors: dict, res) -> None:
    """Keep a traced rank in the cache, so that a killed build resumes without tracing it again."""
    fw, bw = cache.put_blob(res.forward), cache.put_blob(res.backward)
    meta_sha = cache.put_blob(json.dumps(replace(res.meta, forward_graph=fw, backward_graph=bw).to_json(),
                                         indent=1).encode())
    cache.put_rank(rank_key, {"factors": factors, "rank": res.rank, "forward": fw, "backward": bw,
                              "meta": meta_sha, "timings": res.timings})


def _cached_trace(cache: Cache, record: dict):
    meta = RankRecord.from_json(json.loads(cache.read_blob(record["meta"])), f"cached rank {record['rank']}")
    return Trace(rank=record["rank"], forward=cache.read_blob(record["forward"]),
                 backward=cache.read_blob(record["backward"]),
                 meta=replace(meta, forward_graph=None, backward_graph=None))


class CachedTracer:
    """Traces ranks for one build, reusing ranks a killed build of the same key finished.
    `traces` and `keys` are by (rank, depth); depth None is the flavor's own."""

    def __init__(self, spec: BuildSpec, cache: Cache, factors: dict, jobs: int, stage, progress):
        self.spec, self.cache, self.factors, self.jobs = spec, cache, factors, jobs
        self.stage, self.progress = stage, progress
        self.traces: dict = {}
        self.keys: dict[tuple[int, int | None], str] = {}
        self.traced: list[tuple[int, int | None]] = []

    def _factors(self, rank: int, depth: int | None) -> dict:
        return rank_factors(self.factors, self.spec.layout.coordinates(rank), depth=depth)

    def trace(self, ranks: list[int], depths: Callable[[int], tuple[int | None, ...]] = lambda rank: (None,)) -> None:
        todo: dict[int, tuple] = {}
        for r in ranks:
            for d in depths(r):
                self.keys[r, d] = digest(self._factors(r, d))
                record = self.cache.get_rank(self.keys[r, d])
                if record is None:
                    todo[r] = todo.get(r, ()) + (d,)
                else:
                    self.traces[r, d] = _cached_trace(self.cache, record)
            self.stage(r, "queued" if r in todo else "cache hit")
        left = {r: len(depths) for r, depths in todo.items()}
        for res in trace_in_processes(self.spec, trace_tasks(todo, self.jobs), self.jobs, self.stage):
            self.stage(res.rank, "writing")
            with interrupt.deferred():  # a rank's record goes in whole or not at all
                _store_rank(self.cache, self.keys[res.rank, res.depth], self._factors(res.rank, res.depth), res)
            self.traces[res.rank, res.depth] = Trace(rank=res.rank, forward=res.forward, backward=res.backward,
                                                     meta=res.meta)
            self.traced.append((res.rank, res.depth))
            left[res.rank] -= 1
            if not left[res.rank]:
                self.stage(res.rank, "done")
            self.progress(res)

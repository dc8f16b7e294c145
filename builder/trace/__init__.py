"""The build's second stage: each probe rank traced in its own process on a fake process group
with fake tensors. The pool of trace processes (pool, preload), a trace job and its result
(rank_job), the trace itself (rank_trace: parallelize, export the joint graph, partition,
passes, encode), stage reports (rank_progress), and tracing through the cache (cached)."""

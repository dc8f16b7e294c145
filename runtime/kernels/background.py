"""A first run's missing kernels compiled while it trains (titan-run's default on GPUs).

An exact region computes what the ops it replaces compute, bit for bit (fusion.py): that is
what makes it exact. So a run whose kernel store lacks some of its exact regions' kernels (the
default flow's first run on a host) need not wait for them before its first step. Worker
processes (compile_workers.py) compile them into the store while the first steps run the
regions' own ops on eager's kernels; between two steps, once the workers are done, the rank
loads the kernels into its graphs, and its CUDA graph is captured with them. Every loss and
parameter is what a run that waited computes; only the first steps are slower.

Only where that holds: every region the rank compiles is exact (a --fuse region changes the
numbers, so its kernels run from the first step), the graphs call no FlexAttention (on a GPU
its compiled kernels are what runs it), and the rank's kernels are shared (cuda:0). And only
as many workers as fit in the GPU memory the training rank leaves (a worker that runs out
fails, and the rank compiles its regions when it takes the kernels in); where none fits, the
workers compile before the rank allocates anything, as before. The ranks of a
job switch at the same step: they agree once at load whether any of them waits, and then
before each step whether all of them have their kernels (a one-element all-reduce; none with a
single rank), so that no rank captures its step while a peer still runs its collectives one by
one, and every rank runs the same collectives.

A run that ends before its kernels are in waits for its workers at the end: the kernels are
in the store for the next run.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.fx as fx

from titan.runtime.kernels.compile_workers import ParallelResult, Workers, start_workers
from titan.runtime.kernels.fusion import EXACT, FLEX_OPS, FusionStats, KernelSources, compile_regions, region_kind


def only_exact_regions(graphs: tuple[fx.GraphModule, ...]) -> bool:
    """Whether every region of `graphs` is exact and none calls FlexAttention: then the graphs
    run as they are (eager's kernels) compute what their compiled regions compute."""
    for gm in graphs:
        for n in gm.graph.nodes:
            tag = n.meta.get("titan_region")
            if tag is not None and region_kind(tag) != EXACT:
                return False
            if n.op == "call_function" and str(n.target) in FLEX_OPS:
                return False
    return True


class KernelsInBackground:
    """This rank's missing exact kernels, being compiled by worker processes."""

    def __init__(self, graphs: tuple[fx.GraphModule, ...], device: torch.device, sources: KernelSources,
                 workers: Workers):
        self.graphs, self.device, self.sources, self.workers = graphs, device, sources, workers
        self.started = time.perf_counter()

    def ready(self) -> bool:
        return self.workers.done()

    def install(self) -> FusionStats:
        """Replace the regions of the graphs with their kernels (waits for the workers; what
        one did not store is compiled here)."""
        result = self.workers.result()
        self.sources.compiled_by_workers = result.stored
        stats, memo = FusionStats(workers=result.workers, worker_failures=result.failures), {}
        for gm in self.graphs:
            compile_regions(gm, device=self.device, sources=self.sources, stats=stats, memo=memo)
        stats.seconds = time.perf_counter() - self.started
        return stats

    def wait(self) -> ParallelResult:
        """Let the workers finish storing (a run that ends before its kernels are in)."""
        return self.workers.result()


TRAINING_MARGIN = 1.4
"""The rank's GPU memory while it trains, over its program's estimate (runtime/contract/
memory_estimate.py, a lower bound): Llama 3 1B seq 2048 peaked at 28.7 GiB allocated on an H200
(30.8 GB in use on the device) against an estimate of 22.7 GiB."""


def start_in_background(forward: fx.GraphModule, backward: fx.GraphModule, device: torch.device,
                        sources: KernelSources, *, rank_needs: int) -> KernelsInBackground | None:
    """Start compiling the graphs' missing kernels in worker processes; None where a run must
    wait for them instead (see the module docstring), none is missing, or no worker fits in the
    GPU memory the rank leaves while it trains (`rank_needs`: its program's estimate, bytes):
    the workers then compile before the rank allocates anything."""
    graphs = (forward, backward)
    if device.type != "cuda" or not sources.shareable or not only_exact_regions(graphs):
        return None
    spare = torch.cuda.get_device_properties(device).total_memory - int(TRAINING_MARGIN * rank_needs)
    if spare <= 0:
        return None
    workers = start_workers(graphs, device, sources, at_least=1, gpu_bytes=spare)
    return None if workers is None else KernelsInBackground(graphs, device, sources, workers)


def _every_rank(flag: bool, device: torch.device, op) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=op)
    return bool(t.item())


class KernelWait:
    """The job's wait for kernels compiled in the background, as one rank takes part in it:
    `pending` until every rank has its kernels; `poll()` before each step takes them in on the
    step where all have them."""

    def __init__(self, mine: KernelsInBackground | None, device: torch.device):
        self.mine, self.device = mine, device
        self.pending = _every_rank(mine is not None, device, dist.ReduceOp.MAX)  # does any rank wait?

    def poll(self) -> FusionStats | None:
        """Before a step, while pending: installs this rank's kernels when every rank's are
        ready, and returns their statistics (None while waiting, or for a rank that had none
        to wait for)."""
        ready = self.mine is None or self.mine.ready()
        if not _every_rank(ready, self.device, dist.ReduceOp.MIN):
            return None
        self.pending = False
        if self.mine is None:
            return None
        stats, self.mine = self.mine.install(), None
        return stats

    def finish(self) -> ParallelResult | None:
        """At the end of a run still waiting: this rank's workers' result, once they are done."""
        if self.mine is None:
            return None
        result, self.mine = self.mine.wait(), None
        return result

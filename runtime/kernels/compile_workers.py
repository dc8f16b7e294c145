"""A rank's missing regions compiled by parallel processes before it compiles them one by one.

On a fresh host the default flow compiles every distinct exact region at start: 33 for Llama 3
1B, 20 s one after another on an H200 host (inductor's import included), most of a first run's
start. Inductor compiles one graph at a time in a process, so the regions that
neither the artifact nor the kernel store has are shared among worker processes
(`python -m titan.runtime.kernels.compile_workers`), each compiling its share through
load_kernel (under the key's lock, into the kernel store) while the rank waits; the rank's own
pass then finds them in the store as plans. Nothing depends on a worker: what one did not
store, the rank compiles itself, as before.

Only where it pays and is safe: on a GPU whose kernels are shared (cuda:0, fusion.py), with
at least two regions missing and CPUs to spare (the host's CPUs over its ranks, at most
MAX_WORKERS; TITAN_COMPILE_WORKERS sets the number, 0 or 1: none). Plans exist on GPUs only,
so a worker elsewhere would store nothing.

A job is a region as a titan-format graph (graph_encode; the worker decodes it with the
format's checks), its input layouts, kind and key; the worker recomputes the key from what it
decoded and refuses a job whose key differs. It answers one JSON line per job on stdout;
whatever else it prints (a library's warning) is not shown unless it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
import torch.fx as fx

from titan.runtime.common import parent_death
from titan.runtime.contract.graph_decode import load_graph
from titan.runtime.contract.graph_encode import encode_graph
from titan.runtime.kernels.fusion import (FusionStats, KernelSources, compile_region, compiled_here, device_tag,
                                          kernel_context, kernel_key, load_kernel, region_kernels)
from titan.runtime.store.kernel_store import KernelStore

MAX_WORKERS = 4
"""Measured on an H200 host with 16 CPUs (benchmarks/gpu/gpu_compile_workers.sh, Llama 3 1B, 33
regions, two rounds): one after another 19.8 s, 4 workers 15.9 s, 8 workers 17.4 s. A worker
first imports torch and inductor, about 13 s of a fresh process there: more workers pay it more
often for fewer regions each."""
WORKER_BASE_BYTES = 1 << 30
"""A worker's GPU memory besides its regions' tensors: its CUDA context and inductor's buffers."""
WORKERS_ENV = "TITAN_COMPILE_WORKERS"
WORKER_TIMEOUT_S = 600
"""A worker still compiling after this is stopped (the rank compiles the rest)."""
MAX_JOBS_BYTES = 64 << 20


@dataclass(frozen=True)
class ParallelResult:
    stored: frozenset[str]
    """Keys a worker compiled into the kernel store."""
    workers: int
    failures: tuple[str, ...] = ()
    """One line per worker that failed (the rank compiled its share)."""


def worker_count(jobs: int) -> int:
    """Processes for `jobs` regions: TITAN_COMPILE_WORKERS, else the CPUs this process may run
    on over the host's local ranks, at most MAX_WORKERS; never more than the jobs."""
    asked = os.environ.get(WORKERS_ENV, "").strip()
    if asked:
        if not asked.isdigit():
            raise ValueError(f"{WORKERS_ENV}={asked!r} is not a number of processes; set it to 0 (none) or a count")
        n = int(asked)
    else:
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        n = min(MAX_WORKERS, cpus // max(1, int(local) if local.isdigit() else 1))
    return min(n, jobs)


def worker_gpu_bytes(jobs: list[dict]) -> int:
    """GPU memory a worker may take for `jobs`: its base, and five times the inputs of its largest
    region (the inputs, outputs and intermediates a compile and its plan's recording allocate).
    Measured on an H200 (Llama 3 1B, 33 regions): at seq 2048 (the largest region's inputs 0.98
    GiB) 4 workers added 22.4 GB to the host's use, about 5.2 GiB each (this gives 5.9); at seq
    8192 (3.9 GiB) about 56 GB beside a 43.8 GiB rank, 14-19 GiB each (this gives 20.6)."""
    def input_bytes(job: dict) -> int:
        total = 0
        for v in job["layouts"]:
            n = 1
            for size in v["shape"]:
                n *= size
            total += n * torch.empty((), dtype=getattr(torch, v["dtype"])).element_size()
        return total
    return WORKER_BASE_BYTES + 5 * max((input_bytes(j) for j in jobs), default=0)


def missing_regions(graphs: tuple[fx.GraphModule, ...], device: torch.device, sources: KernelSources) -> list[dict]:
    """The distinct regions of `graphs` compiled on `device` that neither the artifact nor the
    kernel store has, as worker jobs."""
    tag = device_tag(device)
    jobs: dict[str, dict] = {}
    for gm in graphs:
        for key, (kind, sub, layouts) in region_kernels(gm, device=tag).items():
            if key in jobs or not compiled_here(kind, device):
                continue
            if sources.from_artifact(key) is not None or sources.from_store(key) is not None:
                continue
            jobs[key] = {"key": key, "kind": kind, "layouts": layouts, "graph": encode_graph(sub, group_names={})}
    return list(jobs.values())


class Workers:
    """Worker processes compiling their shares of the jobs; threads hand them their jobs and
    read their answers, so that the rank goes on meanwhile (runtime/kernels/background.py)."""

    def __init__(self, procs: list[subprocess.Popen], payloads: list[bytes], jobs: int):
        self.count, self.jobs = len(procs), jobs
        self._procs = procs
        self._pool = ThreadPoolExecutor(len(procs))
        self._answers = [self._pool.submit(_talk, proc, data) for proc, data in zip(procs, payloads)]

    def done(self) -> bool:
        return all(answer.done() for answer in self._answers)

    def result(self) -> ParallelResult:
        """Wait for every worker; what they stored and how each ended."""
        outcomes = [answer.result() for answer in self._answers]
        self._pool.shutdown()
        stored: set[str] = set()
        failures = []
        for proc, (out, err) in zip(self._procs, outcomes):
            for line in out.splitlines():
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue  # not an answer (a library printing to stdout)
                if isinstance(answer, dict) and answer.get("stored") is True and isinstance(answer.get("key"), str):
                    stored.add(answer["key"])
            if proc.returncode != 0:
                last = next((s for s in reversed(err.splitlines()) if s.strip()), f"exit {proc.returncode}")
                failures.append(last.strip()[:200])
        return ParallelResult(stored=frozenset(stored), workers=self.count, failures=tuple(failures))


def start_workers(graphs: tuple[fx.GraphModule, ...], device: torch.device, sources: KernelSources, *,
                  at_least: int = 2, gpu_bytes: int | None = None) -> Workers | None:
    """Start compiling the regions of `graphs` that are missing into the kernel store, in worker
    processes; None when none are started: off the GPU, or fewer than `at_least` of them would
    start (see the module docstring). `gpu_bytes`: the GPU memory the workers may take in all
    (beside a rank that trains meanwhile): no more start than worker_gpu_bytes fit in it. (Not
    enforced in the worker: a cap on its allocator at that share made 2 of 4 workers run out on
    an H200, 1B seq 2048, with 101 GiB free; a worker that runs out fails, and the rank compiles
    its regions.)"""
    if device.type != "cuda" or not sources.shareable:
        return None
    jobs = missing_regions(graphs, device, sources)
    n = worker_count(len(jobs))
    if gpu_bytes is not None:
        n = min(n, gpu_bytes // worker_gpu_bytes(jobs))
    if n < max(1, at_least):
        return None
    # Started from this (the main) thread: a child's death signal follows the thread that forked it.
    # Each compiles in its own process: inductor's pool of compile processes, per worker, would
    # put workers x CPUs processes on the host's CPUs.
    env = parent_death.child_env({**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env) for _ in range(n)]
    # The workers store into the rank's own store (a build's --kernels uses its cache's).
    common = {"device": str(device), "store": str(sources.store.root)}
    payloads = [msgpack.packb({**common, "jobs": jobs[i::n]}, use_bin_type=True) for i in range(n)]
    return Workers(procs, payloads, len(jobs))


def compile_in_parallel(graphs: tuple[fx.GraphModule, ...], device: torch.device,
                        sources: KernelSources) -> ParallelResult | None:
    """Compile the regions of `graphs` that are missing into the kernel store in worker
    processes, and wait for them; None when none are started."""
    workers = start_workers(graphs, device, sources)
    return None if workers is None else workers.result()


def _talk(proc: subprocess.Popen, payload: bytes) -> tuple[str, str]:
    try:
        out, err = proc.communicate(payload, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\nstopped after {WORKER_TIMEOUT_S} s"
    return out.decode(errors="replace"), err.decode(errors="replace")


def _serve() -> int:
    parent_death.from_environment()
    data = sys.stdin.buffer.read(MAX_JOBS_BYTES + 1)
    if len(data) > MAX_JOBS_BYTES:
        print(f"compile worker: jobs over {MAX_JOBS_BYTES} bytes", file=sys.stderr)
        return 2
    request = msgpack.unpackb(data, raw=False)
    device = torch.device(request["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sources, stats = KernelSources(device=device, store=KernelStore(Path(request["store"]))), FusionStats()
    context = kernel_context(device_tag(device))
    for job in request["jobs"]:
        sub = load_graph(job["graph"], device=device, groups={})
        kind, layouts = job["kind"], job["layouts"]
        key = kernel_key(sub, layouts, kind, context)
        if key != job["key"]:
            print(json.dumps({"key": job["key"], "error": "the decoded region has another key"}), flush=True)
            continue
        load_kernel(key, lambda: compile_region(sub, layouts, kind, device), device, sources, stats)
        print(json.dumps({"key": key, "stored": key in sources.recorded}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_serve())

"""The compile workers of a fresh host's first run (runtime/kernels/compile_workers.py): the jobs
they are given decode to the regions the rank keys, a worker process compiles what it is given
and refuses a job whose key is not its region's, and they start only where plans can be stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest
import torch

from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.graph_decode import load_graph
from titan.runtime.kernels.compile_workers import MAX_WORKERS, WORKERS_ENV, compile_in_parallel, missing_regions, worker_count
from titan.runtime.kernels.fusion import KernelSources, device_tag, kernel_context, kernel_key
from titan.runtime.rank_graphs import load_rank_graphs
from titan.runtime.store.kernel_store import KernelStore

CPU = torch.device("cpu")


@pytest.fixture
def fused_graphs(debug_artifact):
    """Rank 0's graphs of a debug --fuse artifact: its regions are compiled on the CPU too."""
    return load_rank_graphs(open_artifact(debug_artifact(extra=("--fuse",))), 0, device=CPU, groups={})


def test_each_job_decodes_to_the_region_its_key_names(fused_graphs, tmp_path):
    sources = KernelSources(device=CPU, store=KernelStore(tmp_path / "store"))
    jobs = missing_regions(fused_graphs, CPU, sources)
    assert len(jobs) >= 2 and len({j["key"] for j in jobs}) == len(jobs)
    context = kernel_context(device_tag(CPU))
    for job in jobs:
        sub = load_graph(job["graph"], device=CPU, groups={})
        assert kernel_key(sub, job["layouts"], job["kind"], context) == job["key"]
    # On the CPU no worker starts: a compiled region has no plan there, so nothing would be stored.
    assert compile_in_parallel(fused_graphs, CPU, sources) is None


def test_a_worker_compiles_its_jobs_and_refuses_a_job_whose_key_is_not_its_regions(fused_graphs, tmp_path):
    store = KernelStore(tmp_path / "store")  # the rank's store, which the worker is told to use
    good, other = missing_regions(fused_graphs, CPU, KernelSources(device=CPU, store=store))[:2]
    forged = dict(other, key=good["key"])  # another region under good's key
    payload = msgpack.packb({"device": "cpu", "store": str(store.root), "jobs": [good, forged]}, use_bin_type=True)
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "titan.runtime.kernels.compile_workers"], input=payload,
                       capture_output=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr.decode()
    answers = [json.loads(line) for line in r.stdout.decode().splitlines() if line.startswith("{")]
    # Compiled, but not stored: a CPU region has no plan.
    assert answers == [{"key": good["key"], "stored": False},
                       {"key": good["key"], "error": "the decoded region has another key"}]
    assert store.entries() == []


def test_the_worker_count_follows_the_cpus_the_ranks_and_the_setting(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert worker_count(100) == min(MAX_WORKERS, cpus) and worker_count(1) == min(1, cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))
    assert worker_count(100) == 1  # one CPU per rank: nothing to spare
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert worker_count(100) == 3 and worker_count(2) == 2
    monkeypatch.setenv(WORKERS_ENV, "0")
    assert worker_count(100) == 0
    monkeypatch.setenv(WORKERS_ENV, "many")
    with pytest.raises(ValueError, match=f"{WORKERS_ENV}='many' is not a number"):
        worker_count(100)


def test_a_workers_gpu_share_follows_its_largest_region():
    """What a worker may take beside a training rank (runtime/kernels/background.py sizes their
    number by it): its base and five times the inputs of the largest region it compiles."""
    from titan.runtime.kernels.compile_workers import WORKER_BASE_BYTES, worker_gpu_bytes

    small = {"layouts": [{"shape": [8, 8], "stride": [8, 1], "dtype": "float32"}]}
    large = {"layouts": [{"shape": [2048, 1024], "stride": [1024, 1], "dtype": "bfloat16"},
                         {"shape": [1024], "stride": [1], "dtype": "float32"}]}
    assert worker_gpu_bytes([]) == WORKER_BASE_BYTES
    assert worker_gpu_bytes([small, large]) == WORKER_BASE_BYTES + 5 * (2048 * 1024 * 2 + 1024 * 4)

"""A first run's kernels compiled while it trains (runtime/kernels/background.py): only graphs
whose regions are all exact run before their kernels are in, and the ranks of a job end their
wait at the same step, whichever of them waited, without changing a loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from processes import torchrun_envs
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.kernels.background import only_exact_regions, start_in_background
from titan.runtime.kernels.fusion import KernelSources
from titan.runtime.rank_graphs import load_rank_graphs

WORKER = Path(__file__).parent.parent / "background_worker.py"
CPU = torch.device("cpu")


def _graphs(artifact):
    return load_rank_graphs(open_artifact(artifact), 0, device=CPU, groups={})


def test_only_graphs_whose_regions_are_all_exact_train_before_their_kernels_are_in(debug_artifact):
    default, fused = _graphs(debug_artifact()), _graphs(debug_artifact(extra=("--fuse",)))
    assert any(n.meta.get("titan_region", "").startswith("exact#") for gm in default for n in gm.graph.nodes)
    assert only_exact_regions(default)
    assert not only_exact_regions(fused)  # a --fuse region changes the numbers: its kernels run from step 1
    # Off the GPU no kernel is compiled in the background (exact regions run on eager's kernels there).
    assert start_in_background(*default, CPU, KernelSources(device=CPU), rank_needs=0) is None


def test_the_ranks_take_their_kernels_at_the_same_step_and_train_as_without_the_wait(debug_artifact, tmp_path):
    """Two gloo ranks of an FSDP layout (collectives in the graphs); rank 0 waits for a real
    worker process, rank 1 for nothing: both run on until the worker is done, switch at one step,
    and every loss equals a run without the wait."""
    art = debug_artifact(dp_shard=2)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(art), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in torchrun_envs(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    ranks = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out, _ in outs]
    first, second = sorted(ranks, key=lambda r: r["rank"])
    assert first["switched_at"] is not None and first["switched_at"] == second["switched_at"]
    assert first["worker_done"] and first["installed"] == 1 and second["installed"] == 0
    assert first["switched_at"] > 1  # the worker's start alone outlasts a debug step
    for r in ranks:
        assert len(r["losses"]) == r["switched_at"] + 2
        assert r["losses"] == r["reference"]

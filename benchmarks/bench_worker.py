"""What every benchmark worker shares (train_bench.py's own and the peer rows'): its command
line, how its ranks join, and what it records.

A worker times its steps itself (the device synchronized before and after each), and rank 0
writes one JSON file: step times, reported losses, seconds from the launch of the rank processes
(BENCH_T0) to the end of the first optimizer step, and the device's peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


class StepRecord:
    def __init__(self, device) -> None:
        import torch
        self._torch = torch
        self.device = device
        self.t_launch = float(os.environ["BENCH_T0"])
        self.times: list[float] = []
        self.losses: list[float] = []
        self.first_step_s: float | None = None
        self._t0 = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def stop(self, loss: float) -> None:
        """After the optimizer step; `loss` is a Python float (reading it synchronizes)."""
        self.sync()
        self.times.append(time.perf_counter() - self._t0)
        self.losses.append(loss)
        if self.first_step_s is None:
            self.first_step_s = time.time() - self.t_launch

    def write(self, out: str | Path, **extra) -> None:
        on_gpu = self.device.type == "cuda"
        peak = self._torch.cuda.max_memory_allocated(self.device) / 2**30 if on_gpu else 0.0
        Path(out).write_text(json.dumps({"step_times": self.times, "losses": self.losses,
                                         "first_step_s": self.first_step_s, "peak_gib": peak, **extra}))


def worker_args(modes: list[str]) -> argparse.Namespace:
    """The command line train_bench.py gives a peer worker (one process per rank)."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, choices=modes)
    p.add_argument("--flavor", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--max-norm", type=float, default=0.0, help="clip gradients to this global norm (0: no clip)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="pipeline layouts: micro-batches of --batch-size sequences per step (bench_pipeline.py)")
    return p.parse_args()


def join_ranks():
    """This rank's device and process group, as a row's ranks start: NCCL on the rank's GPU, or
    gloo on the CPU (where a row only checks that its script runs). Returns (rank, device)."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return rank, torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return rank, device


def global_loss(loss, layout, mesh):
    """A step's loss as titan-run reports it: the mean over the global batch (summed over the
    data-parallel shards, each already divided by the global token count)."""
    import torch.distributed as dist

    reported = loss.detach().clone()
    if layout.dp_degree > 1:
        dist.all_reduce(reported, group=mesh["dp_shard"].get_group())
    return reported


def leave(record: "StepRecord", rank: int, out) -> None:
    """A worker's end: rank 0 writes the row's record, then every rank leaves the process group."""
    import torch.distributed as dist

    if rank == 0:
        record.write(out)
    dist.barrier()
    dist.destroy_process_group()

"""Process-group setup for one rank: environment (torchrun style), device, backend (the mesh:
runtime/contract/layout.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from titan.runtime.contract.layout import DP_DIMS


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @staticmethod
    def from_environ() -> "RankEnv":
        try:
            rank = int(os.environ["RANK"])
            world = int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):
            raise ValueError("RANK and WORLD_SIZE must be set (run under torchrun, or let titan-run spawn ranks)") from None
        local = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return RankEnv(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)


def pick_device(requested: str, env: RankEnv, *, deterministic: bool = False) -> torch.device:
    """'auto' is CUDA when this host has GPUs, else CPU. `deterministic` selects deterministic
    kernels (cuBLAS workspace, attention backward, scatter/index ops)."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {requested!r}")
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    count = torch.cuda.device_count()
    if os.environ.get("TITAN_VIRTUAL_LOCAL_RANK") == "1":  # titan-run gave this rank its own GPU as cuda:0
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    if env.local_rank >= count:
        raise ValueError(f"this host has {count} GPU(s) but needs {env.local_world_size} for its local ranks; "
                         "run on a host with enough GPUs, or use --device cpu")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


DEFAULT_TIMEOUT_S = 300.0


def init_process_group(env: RankEnv, device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """`timeout_s` bounds how long a rank waits in a collective (or for its peers to join)
    before failing, so a dead peer stops the job in minutes, not the backends' default hours."""
    if env.world_size == 1 or dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=env.rank, world_size=env.world_size, device_id=device,
                                timeout=timeout)
    else:
        dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size, timeout=timeout)


def dp_sum(value: torch.Tensor, mesh) -> torch.Tensor:
    """Sum a per-rank scalar over the data-parallel mesh dimensions (for reporting)."""
    out = value.detach().clone()
    if mesh is None:
        return out
    for name in DP_DIMS:
        if name in mesh.mesh_dim_names:
            dist.all_reduce(out, group=mesh.get_group(name))
    return out


def shutdown() -> None:
    """Tear down the process group once every rank is done with it: destroying it while a peer
    still talks to this rank aborts gloo's worker threads at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int) -> None:
    """End a rank process without interpreter finalization. Gloo's worker threads can still be
    alive when Python tears down (pytorch/pytorch#179291 discusses it), which aborts the process
    ("terminate called without an active exception") after all work has finished; every
    output this process wrote is flushed first."""
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

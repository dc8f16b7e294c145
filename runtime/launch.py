"""Spawn the local ranks of a job as torchrun would, and supervise them.

Each rank is `python -m <module> <args>` with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set, so a spawned rank and a torchrun rank take the same code path. When one rank
fails, the others are stopped (they would block in a collective) and its exit code returned.

The launcher hosts the rendezvous store itself (as torchrun's agent does), on a port the OS
gives it and that it holds for the whole job: picking a free port and letting rank 0 bind it
later races with other jobs and sockets in TIME_WAIT (EADDRINUSE).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

STOP_GRACE_S = 5.0


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _rank_gpus(world_size: int) -> list[str] | None:
    """The GPU each local rank gets (as CUDA_VISIBLE_DEVICES names it), when the host has one per
    rank. Each rank then sees only its own GPU, as cuda:0 (as torchrun --virtual-local-rank
    does): generated kernels name their device index, and this way every rank's kernels are
    the same kernels (runtime/fusion.py)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ids[:world_size] if len(ids) >= world_size else None


def spawn_local(module: str, args: list[str], world_size: int) -> int:
    """Run `world_size` ranks on this host; returns 0, or the first failing rank's exit code."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    gpus = _rank_gpus(world_size)
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True", PYTHONUNBUFFERED="1")
        if gpus is not None:
            env.update(CUDA_VISIBLE_DEVICES=gpus[rank], TITAN_VIRTUAL_LOCAL_RANK="1")
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130

"""Spawn the local ranks of a job as torchrun would, and supervise them.

Each rank is `python -m <module> <args>` with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set, so a spawned rank and a torchrun rank take the same code path. When one rank
fails, the others are stopped (they would block in a collective) and the job fails with the
first failure's cause: a rank killed by a signal is named with it (`error: rank 1 was killed by
SIGKILL`), and that comes before the peers that then lost it.

The ranks start with SIGINT blocked (runtime/common/interrupt.py): a Ctrl-C reaches only this launcher,
which stops them (and anything they started) and prints the one `interrupted` line. A launcher
killed outright takes its ranks with it (runtime/common/parent_death.py).

The launcher hosts the rendezvous store itself (as torchrun's agent does), on a port the OS
gives it and that it holds for the whole job: picking a free port and letting rank 0 bind it
later races with other jobs and sockets in TIME_WAIT (EADDRINUSE).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import titan.runtime.common.interrupt as interrupt
import titan.runtime.common.parent_death as parent_death

if TYPE_CHECKING:
    from titan.runtime.contract.artifact import Artifact
    from titan.runtime.contract.manifest import Manifest
    from titan.runtime.run_config import RunConfig

PID_KEY = "titan/pid/{rank}"


def run_start_key(manifest: Manifest, device: str) -> str:
    """Names a run's start-up time (runtime/common/timings.py): the build and the --device asked for."""
    return f"{manifest.cache_key}-{device}"


def check_run(art: Artifact, cfg: RunConfig) -> tuple[str, list[str]]:
    """The checks every rank will make, made once before any starts; returns what the run
    starts from (for its `start:` line) and the notes the checks made."""
    from titan.runtime.run_state import RunState

    art.verify_all()
    # Every rank's checks, once (of the whole model's parameters and buffers: a pipeline rank holds
    # only its stages').
    state = RunState(cfg, art.manifest, art.model_params(), buffers=art.model_buffers())
    state.close()
    if cfg.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        from titan.runtime.step_log import TENSORBOARD_HINT
        raise ValueError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}")
    if cfg.device != "cpu":
        check_gpus(art.world_size, cfg.device)
    return state.origin(), state.notes


def launch(art: Artifact, *, started: float, module: str, args: list[str]) -> int:
    """Spawn the run's ranks on this host (`python -m module args`, as torchrun would start
    them); returns the job's exit code. Rank 0 times the run's start-up from `started`."""
    _mark_start(started)
    return spawn_local(module, args, art.world_size)


def become_the_rank(*, started: float) -> None:
    """Make this process the job's one rank (a world size of 1): the environment a spawned rank
    would get, set here. A second interpreter would only import torch again (seconds of a
    start that should take few); a signal ends this process as it ends a launcher (its undo
    actions, one line), so nothing else differs."""
    _mark_start(started)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1")


def _mark_start(started: float) -> None:
    from titan.runtime.startup import SPAWNED_ENV, STARTED_ENV

    os.environ[STARTED_ENV] = repr(started)
    os.environ[SPAWNED_ENV] = repr(time.time())


def check_gpus(world_size: int, device: str) -> None:
    """Refuse a job this host's GPUs cannot hold, before any rank starts."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and count < world_size:
        raise ValueError(f"the artifact has {world_size} ranks but this host has {count} GPU(s); "
                         "launch with torchrun across hosts, or use --device cpu")


def _rank_gpus(world_size: int) -> list[str] | None:
    """The GPU each local rank gets (as CUDA_VISIBLE_DEVICES names it), when the host has one per
    rank. Each rank then sees only its own GPU, as cuda:0 (as torchrun --virtual-local-rank
    does): generated kernels name their device index, and this way every rank's kernels are
    the same kernels (runtime/kernels/fusion.py)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ids[:world_size] if len(ids) >= world_size else None


def spawn_local(module: str, args: list[str], world_size: int) -> int:
    """Run `world_size` ranks on this host; returns 0, or the exit code of the failure."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    gpus = _rank_gpus(world_size)
    procs: list[subprocess.Popen] = []
    # Every descendant, not just those in `procs`: a signal can come between a rank's start and its
    # append, and a rank may have started processes of its own.
    forget = interrupt.on_interrupt(lambda: interrupt.stop_processes(interrupt.descendant_pids()))
    try:
        with interrupt.children_ignore_ctrl_c():
            for rank in range(world_size):
                env = dict(parent_death.child_env(os.environ), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           TORCHELASTIC_USE_AGENT_STORE="True", PYTHONUNBUFFERED="1")
                if gpus is not None:
                    env.update(CUDA_VISIBLE_DEVICES=gpus[rank], TITAN_VIRTUAL_LOCAL_RANK="1")
                procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env))
        return _supervise(procs)
    finally:
        interrupt.stop_processes([p.pid for p in procs if p.returncode is None])
        forget()


def _supervise(procs: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A rank killed by a signal is the cause; its peers failing in a collective, the effect.
            rank, code = min(failed, key=lambda f: (f[1] > 0, f[0]))
            if code < 0:
                print(f"error: rank {rank} was killed by {_signal_name(-code)}"
                      f"{' (out of memory? see dmesg)' if -code == signal.SIGKILL else ''}; the job is stopped",
                      file=sys.stderr, flush=True)
                return 1
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def register_rank(store, rank: int) -> None:
    """Record this rank's host and process id, so that a peer can name it if it dies."""
    store.set(PID_KEY.format(rank=rank), f"{socket.gethostname()} {os.getpid()}")


def dead_peers(store, rank: int, world_size: int) -> list[int]:
    """The ranks on this host whose process is gone (or a zombie); ranks elsewhere are not known."""
    host, dead = socket.gethostname(), []
    for peer in range(world_size):
        key = PID_KEY.format(rank=peer)
        if peer == rank or not store.check([key]):
            continue
        peer_host, pid = store.get(key).decode().split()
        if peer_host == host and not _alive(int(pid)):
            dead.append(peer)
    return dead


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

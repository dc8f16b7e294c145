"""Processes as the tests start ranks and look for what a run left: torchrun's environment for
local ranks, and the live processes of this machine."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterator


def process_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, fields) of each process, `fields` being /proc/<pid>/stat after the command name:
    [0] the state ('Z': a zombie), [1] the parent pid, [3] the session id."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended while we looked
            continue
        yield int(stat.parent.name), fields


def children(pid: int) -> list[int]:
    return [child for child, fields in process_stats() if int(fields[1]) == pid]


def session_pids(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    return [pid for pid, fields in process_stats() if int(fields[3]) == sid and fields[0] != "Z"]


def torchrun_envs(world_size: int, **extra: str) -> list[dict[str, str]]:
    """The environment torchrun gives each of `world_size` ranks on this host (a free port for
    their rendezvous), plus `extra`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
            for rank in range(world_size)]


def default_sigint() -> None:
    """Ctrl-C as in a terminal, whatever this test runner inherited (a Popen preexec_fn): a job
    started in the background by a non-interactive shell ignores SIGINT, and its children would too."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)

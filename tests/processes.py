"""Processes as the tests start ranks and look for what a run left: torchrun's environment for
local ranks, and the live processes of this machine."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
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


MARK_ENV = "TITAN_TEST_PROCESS_MARK"


def marked_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with a mark of its own (MARK_ENV): every process started from a command run with it
    inherits the mark, however it was started (exec or fork) and whoever its parent is now."""
    return {**env, MARK_ENV: uuid.uuid4().hex}


def _has_mark(pid: int, mark: bytes) -> bool:
    try:
        return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # it ended while we looked
        return False


def command_pids(sid: int, env: dict[str, str]) -> list[int]:
    """The live processes of a command started as the leader of session `sid` with the
    environment `env` (from marked_env): those of its session and those carrying its mark, so
    that one that left the session or was re-parented to init is found too."""
    mark = f"{MARK_ENV}={env[MARK_ENV]}".encode()
    return [pid for pid, fields in process_stats()
            if fields[0] != "Z" and (int(fields[3]) == sid or _has_mark(pid, mark))]


def left_behind(sid: int, env: dict[str, str], *, within_s: float) -> list[str]:
    """The processes of a command (as command_pids) still live `within_s` seconds after it ended
    (a killed command's children take a moment to notice), each as 'pid command line'."""
    deadline = time.monotonic() + within_s
    while (pids := command_pids(sid, env)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{pid} {_command_line(pid)}" for pid in pids]


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "(ended)"


def kill_all(sid: int, env: dict[str, str]) -> None:
    """SIGKILL every process of a command (as command_pids): a failed test leaves nothing either."""
    for pid in command_pids(sid, env):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


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
    signal.signal(signal.SIGINT, signal.SIG_DFL)

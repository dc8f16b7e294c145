"""The live processes of this machine, as the fault and interrupt tests look for those a run left."""

from __future__ import annotations

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

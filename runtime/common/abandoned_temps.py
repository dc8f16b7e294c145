"""Temp files and directories named after the process writing them, so that the next writer
removes those a killed writer left.

A command stopped by SIGINT / SIGTERM removes its temps itself (runtime/common/interrupt.py), but one
killed outright (SIGKILL, the OOM killer) runs nothing (issue 33). So a temp's name carries its
writer as `<pid>@<host>`, and a writer removes, before it writes, the temps beside it whose
writer is a process of this host that is gone. A temp of another host (a shared cache) is
never judged: its writer may be alive there. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
from pathlib import Path

_OWNER = re.compile(r"\.(\d+)@([A-Za-z0-9_-]+)\.")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())


def owner_tag() -> str:
    """`<pid>@<host>` of this process, to put between dots in a temp's name."""
    return f"{os.getpid()}@{_host()}"


def is_abandoned(name: str) -> bool:
    """Whether `name` is a temp (named with owner_tag) whose writer on this host is gone."""
    m = _OWNER.search(name)
    if m is None or m.group(2) != _host():
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def remove_abandoned(folder: Path, prefix: str) -> None:
    """Remove the abandoned temps (files or directories) in `folder` whose names start with `prefix`."""
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith(prefix) and is_abandoned(entry.name):
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)

"""How long a command's slow phase took last time (start-up before step 1, a build, a verify),
so that its first line can say what to expect: `(last time 9.1 s)`.

One small JSON file per phase and build in `$TITAN_CACHE_DIR/timings/`, written by rename;
best effort: an unwritable or damaged file only means no estimate.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from titan.runtime.common.abandoned_temps import owner_tag, remove_abandoned
from titan.runtime.common.environment import cache_root


def _path(phase: str, key: str) -> Path:
    return cache_root() / "timings" / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{phase}-{key}")[:200]


def last(phase: str, key: str) -> float | None:
    """Seconds the phase took last time for this key, or None."""
    try:
        seconds = json.loads(_path(phase, key).read_text())["seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(seconds) if isinstance(seconds, (int, float)) and seconds >= 0 else None


def record(phase: str, key: str, seconds: float) -> None:
    path = _path(phase, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(path.parent, ".tmp.")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp.{owner_tag()}.")
        with os.fdopen(fd, "w") as f:
            json.dump({"seconds": round(seconds, 3)}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def expectation(phase: str, key: str) -> str:
    """' (last time 9.1 s)', or '' when unknown."""
    seconds = last(phase, key)
    return "" if seconds is None else f" (last time {seconds:.1f} s)"

"""Where a token file's sidecar lives: titan-data writes it, the runtime reads it (runtime/data.py).

Standard library only, so that titan-data, which needs no torch, does not import it (4 s of
every titan-data command, and of every mistake it refuses)."""

from __future__ import annotations

from pathlib import Path


def sidecar_path(path: str | Path) -> Path:
    """Where titan-data records a token file's dtype, vocabulary and sources."""
    return Path(f"{path}.json")

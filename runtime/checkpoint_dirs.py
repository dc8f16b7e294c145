"""Where a --checkpoint-dir keeps its steps, and which are complete (runtime/checkpoint.py
writes and reads them). Standard library only: a launcher's signal handler uses it, possibly
before torch is imported."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

STATE_FILE = "titan.json"
_STEP_DIR = re.compile(r"step-(\d{8})")


def step_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = _STEP_DIR.fullmatch(child.name)
        if m and (child / STATE_FILE).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def remove_partial_saves(root: str | os.PathLike) -> None:
    """Remove the partial step directories under `root`: of a save that was cut (one job
    writes a checkpoint directory at a time, so none is being written when this runs)."""
    for partial in Path(root).glob(".step-*.partial"):
        shutil.rmtree(partial, ignore_errors=True)


def resolve_checkpoint(path: str | os.PathLike, *, flag: str, step_dir_ok: bool) -> Path:
    """The latest complete step directory of a --checkpoint-dir (or, if `step_dir_ok`, a step
    directory itself)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        if step_dir_ok:
            return path
        raise ValueError(f"{flag} {path} is one step's directory; pass the directory that holds the step-N "
                         f"directories ({path.parent})")
    steps = complete_steps(path)
    if not steps:
        fix = ("point it at a --checkpoint-dir written by titan-run" if step_dir_ok else
               "train with --checkpoint-dir first, or drop --resume to start from scratch")
        raise ValueError(f"{flag} {path}: no complete checkpoint there (no step-*/{STATE_FILE}); {fix}")
    return step_path(path, steps[-1])

"""The files and directories a run names, and the option combinations that need no file, checked
before anything slow happens: titan-run and
titan-verify check them before they import torch or start a rank, so that a typo is one line
at once (issue 33: it took 5-11 s, after a line saying the ranks were starting). Each rank
checks them again (a torchrun job has no launcher to do it).

Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path


def _readable_file(flag: str, path: str, fix: str) -> None:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {path}: no such file; {fix}")
    if not p.is_file():
        raise ValueError(f"{flag} {path} is not a file; {fix}")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{flag} {path} cannot be read (permission denied); make it readable, or {fix}")


def _writable_place(flag: str, path: str, *, directory: bool) -> None:
    """`path` can be written: it is a writable directory (directory=True) or file, or it does
    not exist yet and its nearest existing parent is a writable directory."""
    p = Path(path)
    if p.exists():
        if directory and not p.is_dir():
            raise ValueError(f"{flag} {path} is a file, not a directory; give a directory")
        if not os.access(p, os.W_OK):
            raise ValueError(f"{flag} {path} cannot be written (permission denied); choose a writable place")
        return
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {parent} cannot be written (permission denied); choose a writable place")


def check_run_paths(*, data: str | None = None, checkpoint_dir: str | None = None, resume: bool = False,
                    init_from_hf: str | None = None, metrics: str | None = None,
                    tensorboard: str | None = None) -> None:
    """Raise ValueError, with the fix, when a named input is missing or unreadable or a named
    output cannot be written. What the files hold is checked later (runtime/run_state.py)."""
    if data is not None:
        _readable_file("--data", data, "write a token file with titan-data TEXT -o FILE --tokenizer tokenizer.json, "
                                        "or drop --data to train on synthetic tokens")
    if init_from_hf is not None:
        hf = Path(init_from_hf)
        if not hf.is_dir():
            raise ValueError(f"--init-from-hf {init_from_hf}: no such directory; give a Hugging Face model directory "
                             "(config.json and *.safetensors)")
        if not (hf / "config.json").is_file():
            raise ValueError(f"--init-from-hf {init_from_hf}: no config.json there; give a Hugging Face model "
                             "directory (config.json and *.safetensors)")
        _readable_file("--init-from-hf", str(hf / "config.json"), "make the Hugging Face model directory readable")
        if not any(hf.glob("*.safetensors")):
            raise ValueError(f"--init-from-hf {init_from_hf} holds no *.safetensors files; download the weights "
                             "(safetensors) into it")
    if checkpoint_dir is not None:
        ckpt = Path(checkpoint_dir)
        if resume:
            if not ckpt.is_dir():
                raise ValueError(f"--resume --checkpoint-dir {checkpoint_dir}: no such directory; give the "
                                 "--checkpoint-dir of the run to continue, or drop --resume to start from scratch")
            if not os.access(ckpt, os.R_OK | os.X_OK):
                raise ValueError(f"--checkpoint-dir {checkpoint_dir} cannot be read (permission denied)")
        _writable_place("--checkpoint-dir", checkpoint_dir, directory=True)
    if metrics is not None:
        _writable_place("--metrics", metrics, directory=False)
    if tensorboard is not None:
        _writable_place("--tensorboard", tensorboard, directory=True)


def check_option_combinations(*, steps: int, checkpoint_dir: str | None, checkpoint_every: int | None,
                              resume: bool, init_from_hf: str | None) -> None:
    """Raise ValueError, with the fix, for options that contradict each other."""
    if steps == 0 and checkpoint_dir is None:
        raise ValueError("--steps 0 trains nothing; pass --steps N, or add --checkpoint-dir DIR to checkpoint "
                         "the initial weights")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR (where to write the checkpoints)")
    if resume and init_from_hf is not None:
        raise ValueError("--resume continues from a titan checkpoint, which holds the weights --init-from-hf "
                         "started from: pass only one of them (drop --init-from-hf to resume)")
    if resume and checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir DIR (the directory the earlier run wrote to)")

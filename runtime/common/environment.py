"""Facts about this host that every command reads without importing torch: where titan's
caches and key live and which torch is installed."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path


def cache_root() -> Path:
    """The shared cache of builds and compiled kernels: $TITAN_CACHE_DIR, else ~/.cache/titan."""
    return Path(os.environ.get("TITAN_CACHE_DIR") or "~/.cache/titan").expanduser()


KEY_FILE_ENV = "TITAN_KEY_FILE"


def key_file() -> Path:
    """This user's signing key file: $TITAN_KEY_FILE, else ~/.config/titan/cache.key."""
    return Path(os.environ.get(KEY_FILE_ENV) or "~/.config/titan/cache.key").expanduser()


def installed_torch_version() -> str:
    """torch's version without importing torch (3 s here): the cache-hit path needs only this."""
    return importlib.metadata.version("torch")


def torch_release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': the local build tag does not change graphs."""
    return version.split("+", 1)[0]

"""The kernel store: compiled fusion regions, beside the build cache ($TITAN_CACHE_DIR/kernels).

Each entry is `<key>.bin` (inductor's compiled artifact) with `<key>.sha256` (its digest,
written by titan-run when it stored the entry); an entry is loaded only if the two agree. A
load marks the entry used (the .bin's mtime), which is what `titan-cache gc --older-than`
goes by. This module imports no torch: titan-cache reads and prunes the store without it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from titan.runtime.artifact import cache_root, file_sha256

STALE_TEMP_S = 3600.0
"""Temp files older than this are left over from a killed writer."""


def kernel_store_root() -> Path:
    """Beside the build cache: $TITAN_CACHE_DIR/kernels (default ~/.cache/titan/kernels)."""
    return cache_root() / "kernels"


@dataclass(frozen=True)
class KernelEntry:
    key: str
    size: int
    last_used: float


class KernelStore:
    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else kernel_store_root()

    def load(self, key: str):
        """The compiled region stored under `key`, or None (absent, torn or edited)."""
        path, digest = self.root / f"{key}.bin", self.root / f"{key}.sha256"
        if not path.is_file() or not digest.is_file():
            return None
        if file_sha256(path) != digest.read_text().strip():
            return None  # compile again and replace it
        from torch._inductor import CompiledArtifact

        compiled = CompiledArtifact.load(path=str(path), format="binary")
        try:
            os.utime(path)  # last use, for titan-cache gc
        except OSError:
            pass  # a read-only store still serves
        return compiled

    def save(self, key: str, compiled) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".tmp")
        os.close(fd)
        try:
            compiled.save(path=tmp, format="binary")
            digest = file_sha256(Path(tmp))
            os.replace(tmp, self.root / f"{key}.bin")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        sidecar = self.root / f".{key}.sha256.tmp{os.getpid()}"
        sidecar.write_text(digest + "\n")
        os.replace(sidecar, self.root / f"{key}.sha256")

    def entries(self) -> list[KernelEntry]:
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.glob("*.bin"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # removed meanwhile
            out.append(KernelEntry(key=path.stem, size=st.st_size, last_used=st.st_mtime))
        return out

    def size(self) -> int:
        return sum(e.size for e in self.entries())

    def remove(self, key: str) -> None:
        (self.root / f"{key}.bin").unlink(missing_ok=True)
        (self.root / f"{key}.sha256").unlink(missing_ok=True)

    def verify(self, *, remove: bool) -> tuple[int, list[str]]:
        """Re-hash every entry against its recorded digest; returns (checked, bad keys). With
        remove, delete the bad ones (titan-run would compile them again anyway)."""
        checked, bad = 0, []
        for e in sorted(self.entries(), key=lambda e: e.key):
            checked += 1
            digest = self.root / f"{e.key}.sha256"
            try:
                ok = digest.is_file() and file_sha256(self.root / f"{e.key}.bin") == digest.read_text().strip()
            except FileNotFoundError:
                continue
            if not ok:
                bad.append(e.key)
                if remove:
                    self.remove(e.key)
        return checked, bad

    def gc(self, *, older_than_s: float, now: float | None = None) -> tuple[int, int]:
        """Remove entries unused for longer than `older_than_s`, digests without an entry and
        stale temp files; returns (entries removed, bytes freed)."""
        now = time.time() if now is None else now
        removed = freed = 0
        for e in self.entries():
            if now - e.last_used > older_than_s:
                self.remove(e.key)
                removed += 1
                freed += e.size
        if self.root.is_dir():
            for path in self.root.iterdir():
                orphan = path.suffix == ".sha256" and not (self.root / f"{path.stem}.bin").exists()
                if (orphan or path.name.startswith(".")) and now - path.stat().st_mtime > STALE_TEMP_S:
                    path.unlink(missing_ok=True)
        return removed, freed

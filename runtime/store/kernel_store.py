"""The kernel store: compiled fusion regions, beside the build cache ($TITAN_CACHE_DIR/kernels).

A ContentStore (runtime/store/content_store.py): each compiled region's bytes are a blob, and an
authenticated record `kernels/<kernel key>.json` names the blob's sha256 (the key says what
shapes the code: region graph, input layouts, compile settings, GPU architecture, torch and
triton versions; runtime/kernels/fusion.py computes it). A kernel is served only through such a
record, re-hashed as it is read, so a kernel planted by whoever else can write the directory is
never loaded: the region is compiled again. Compiling a key happens under its lock, so the
ranks of a host compile each kernel once and the others load it. A load marks the kernel used
(used/<key>), which is what `titan-cache gc --older-than` goes by. No torch here: titan-cache
reads and prunes the store without it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from titan.runtime.common.environment import cache_root
from titan.runtime.store.content_store import SHA256, ContentStore, layout_problems
from titan.runtime.store.lock import StoreLock
from titan.runtime.contract.manifest import MAX_KERNEL_BYTES

RECORD_KIND = "kernels"
KERNEL_KEY = re.compile(r"[0-9a-f]{32}")
STALE_TEMP_S = 3600.0
"""Temp files older than this are left over from a killed writer."""


def kernel_store_root() -> Path:
    """Beside the build cache: $TITAN_CACHE_DIR/kernels (default ~/.cache/titan/kernels)."""
    return cache_root() / "kernels"


@dataclass(frozen=True)
class KernelEntry:
    key: str
    sha256: str
    size: int
    last_used: float


class KernelStore:
    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else kernel_store_root()
        self.store = ContentStore(self.root, record_kinds=(RECORD_KIND,), titan_made_root=True)

    def load(self, key: str) -> tuple[bytes, str] | None:
        """The compiled region's bytes and sha256 stored under `key`, or None (absent, not
        authenticated, torn or edited: then it is compiled again)."""
        record = self.store.get_record(RECORD_KIND, key)
        if record is None or record.get("key") != key:
            return None
        try:
            data = self.store.read_blob(record.get("sha256"), max_size=MAX_KERNEL_BYTES, what="kernel")
        except ValueError:
            # Damaged (or gone): drop what is left of it, so that the recompiled kernel's blob is the
            # only one the record names and verify has no orphan to report.
            if isinstance(record.get("sha256"), str) and SHA256.fullmatch(record["sha256"]):
                self.store.remove_blob(record["sha256"])
            return None
        try:
            self.store.touch(key)  # last use, for titan-cache gc
        except ValueError:
            pass  # a read-only store still serves
        return data, record["sha256"]

    def save(self, key: str, data: bytes, *, device: str) -> str:
        """Store a compiled region; returns its sha256."""
        assert KERNEL_KEY.fullmatch(key), key
        sha = self.store.put_blob(data)
        self.store.put_record(RECORD_KIND, key, {"key": key, "sha256": sha, "size": len(data), "device": device})
        self.store.touch(key)
        return sha

    def lock(self, key: str) -> StoreLock:
        return self.store.lock(key)

    def entries(self) -> list[KernelEntry]:
        out = []
        for key in self.store.record_names(RECORD_KIND):
            record = self.store.get_record(RECORD_KIND, key)
            if record is None or not isinstance(record.get("sha256"), str):
                continue
            last = self.store.last_used(key) or self.store.record_mtime(RECORD_KIND, key) or 0.0
            out.append(KernelEntry(key=key, sha256=record["sha256"], size=int(record.get("size", 0)), last_used=last))
        return out

    def size(self) -> int:
        return sum(e.size for e in self.entries())

    def remove(self, key: str) -> None:
        self.store.remove_record(RECORD_KIND, key)
        self.store.untouch(key)

    def verify(self, *, remove: bool) -> tuple[int, list[str], list[str]]:
        """Authenticate every record and re-hash its blob; returns (checked, keys whose blob is
        corrupt or missing, tampered: unauthenticated records, unreferenced blobs, planted files). With remove, delete them
        (titan-run compiles those regions again)."""
        checked, bad, tampered = 0, [], []
        named = set()
        for key in self.store.record_names(RECORD_KIND):
            checked += 1
            record, why = self.store.record_state(RECORD_KIND, key)
            if record is None:
                tampered.append(f"kernel {why}")
            else:
                named.add(record.get("sha256"))
                if self.store.blob_intact(record.get("sha256"), max_size=MAX_KERNEL_BYTES):
                    continue
                bad.append(key)
            if remove:
                self.remove(key)
        strays = self.store.strays()
        tampered += [f"{self.root / s} is not something titan makes (planted?)" for s in strays]
        for foreign in self.store.foreign_records(RECORD_KIND):
            if foreign.planted:
                tampered.append(f"kernel record {foreign.name}@{foreign.uid} is not owned by uid {foreign.uid} (planted?)")
                if remove:
                    self.store.remove_foreign_record(RECORD_KIND, foreign)
        named |= self.store.foreign_blob_refs()  # another user's kernels are theirs, not planted
        for blob in self.store.blobs():
            if blob.sha not in named:
                tampered.append(f"kernel blob {blob.sha[:12]} is named by no authenticated record (planted?)")
                if remove:
                    self.store.remove_blob(blob.sha)
        if remove:
            for s in strays:
                self.store.remove_stray(s)
        return checked, bad, tampered

    def gc(self, *, older_than_s: float, now: float | None = None) -> tuple[int, int]:
        """Remove kernels unused for longer than `older_than_s`, blobs no record names and stale
        temp files; returns (kernels removed, bytes freed)."""
        now = time.time() if now is None else now
        removed = freed = 0
        live = set()
        for e in self.entries():
            if now - e.last_used > older_than_s:
                self.remove(e.key)
                removed += 1
                freed += e.size
            else:
                live.add(e.sha256)
        live |= self.store.foreign_blob_refs()  # another user's kernels stay
        for blob in list(self.store.blobs()):
            if blob.sha not in live and now - blob.mtime > STALE_TEMP_S:
                self.store.remove_blob(blob.sha)
        self.store.sweep_tmp(now=now, grace_s=STALE_TEMP_S)
        return removed, freed


def kernel_store_problems(root: Path) -> list[str]:
    return layout_problems(root, ("blobs", "used", "locks", "tmp", RECORD_KIND))

"""The content-addressed build cache shared by all jobs on a machine (or a shared filesystem),
a ContentStore (runtime/store/content_store.py):

    <root>/blobs/<aa>/<sha256>      graph blobs and program / rank metadata, named by content
    <root>/ranks/<rank key>.json    one traced rank: its factors and blob hashes (authenticated)
    <root>/entries/<key>.json       one build: factors, its programs' blobs, the program of each
                                    rank, the traced ranks' keys, manifest fields, kernels (authenticated)
    <root>/used/<key>               touched on every use (its mtime is the last use)
    <root>/locks/<key>.lock         held while a build of that key runs
    <root>/tmp/                     files being written
    <root>/kernels/                 the kernel store (runtime/store/kernel_store.py), a store of its own

Every file is written to tmp/ and renamed into place, and an entry is written only after
everything it names is in place, so a builder killed at any moment leaves at most unreferenced
blobs and temp files (gc removes them), never an entry that points at something missing.
Records are served only when authenticated with the user's key, and readers re-hash every blob
they use, once per process (a verified blob is kept in memory: a cache hit hashes each distinct
blob once), so a hit serves exactly what this user's titan-build recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from titan.runtime.common.environment import cache_root
from titan.runtime.store.content_store import ContentStore, StoreError, layout_problems, remove_planted_dirs
from titan.runtime.store.lock import StoreLock

# gc leaves unreferenced files younger than this alone: a running build may be about to commit them.
UNREFERENCED_GRACE_S = 600.0
MAX_BLOB_BYTES = 1 << 30
"""Largest graph or metadata blob read from the cache."""
RECORD_KINDS = ("ranks", "entries")
KERNELS_DIR = "kernels"
RANK_BLOBS = ("forward", "backward", "meta")

CacheError = StoreError
"""The cache cannot be used; the message says why."""


@dataclass(frozen=True)
class EntryInfo:
    key: str
    entry: dict
    size: int
    last_used: float


class Cache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root).expanduser() if root else cache_root()
        self.store = ContentStore(self.root, record_kinds=RECORD_KINDS, extra_dirs=(KERNELS_DIR,))
        self._verified: dict[str, bytes] = {}

    # --- blobs -----------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        return self.store.put_blob(data)

    def read_blob(self, sha: str) -> bytes:
        """The blob's bytes; CacheError if it is missing or does not match its hash."""
        if sha not in self._verified:
            self._verified[sha] = self.store.read_blob(sha, max_size=MAX_BLOB_BYTES)
        return self._verified[sha]

    # --- ranks and entries ------------------------------------------------------------------
    def put_rank(self, rank_key: str, record: dict) -> None:
        self.store.put_record("ranks", rank_key, record)

    def rank_record(self, rank_key: str) -> dict | None:
        """A traced rank's authenticated record (its blobs unchecked), else None."""
        return self.store.get_record("ranks", rank_key)

    def get_rank(self, rank_key: str) -> dict | None:
        """A traced rank whose record is authenticated and whose blobs are all present and intact, else None."""
        record = self.rank_record(rank_key)
        if record is None or not all(self.store.blob_intact(record.get(k), max_size=MAX_BLOB_BYTES)
                                     for k in RANK_BLOBS):
            return None
        return record

    def put_entry(self, key: str, entry: dict) -> None:
        self.store.put_record("entries", key, entry)

    def entry_record(self, key: str) -> dict | None:
        return self.store.get_record("entries", key)

    def get_entry(self, key: str) -> tuple[dict | None, str]:
        """(entry, '') when it is authenticated and every blob of its programs verifies (each
        distinct blob hashed once); else (None, why)."""
        entry, why = self.store.record_state("entries", key)
        if entry is None:
            return None, "no entry for this key" if why == "missing" else f"the entry: {why}"
        programs = entry.get("programs")
        if not isinstance(programs, list) or not programs:
            return None, "the entry is from an older titan (no programs)"
        for sha in sorted({p[k] for p in programs for k in ("forward", "backward", "meta")}):
            try:
                self.read_blob(sha)  # each distinct blob once
            except CacheError as e:
                return None, f"the entry's {e}"
        return entry, ""

    def touch(self, key: str) -> None:
        self.store.touch(key)

    def lock(self, key: str, *, on_wait: Callable[[str], None] | None = None,
             on_give_up: Callable[[str, float], None] | None = None) -> StoreLock:
        """This user's lock for building `key`: calls on_wait(holder) once if another process
        holds it, and after a bounded wait (store_lock.lock_wait_s) on_give_up(holder, waited_s),
        returning the lock unheld (the build goes on without it)."""
        lock = self.store.lock(key)
        lock.acquire(blocking=True, on_wait=on_wait, on_give_up=on_give_up)
        return lock

    # --- listing, verification, gc ------------------------------------------------------------
    def entry_keys(self) -> list[str]:
        return self.store.record_names("entries")

    @staticmethod
    def program_blobs(entry: dict) -> set[str]:
        """The blobs of an entry's programs (what its artifact is exported from)."""
        return {p[k] for p in entry.get("programs", []) for k in ("forward", "backward", "meta")}

    def entry_blobs(self, entry: dict) -> set[str]:
        shas = self.program_blobs(entry)
        for rank_key in entry.get("ranks", []):
            record = self.rank_record(rank_key) or {}
            shas.update(record.get(k) for k in RANK_BLOBS if isinstance(record.get(k), str))
        return shas

    def info(self, key: str, sizes: dict[str, int] | None = None) -> EntryInfo | None:
        entry = self.entry_record(key)
        if entry is None:
            return None
        sizes = sizes if sizes is not None else self._blob_sizes()
        size = sum(sizes.get(s, 0) for s in self.entry_blobs(entry))
        last = self.store.last_used(key) or entry.get("created_ts", 0.0)
        return EntryInfo(key=key, entry=entry, size=size, last_used=last)

    def _blob_sizes(self) -> dict[str, int]:
        return {b.sha: b.size for b in self.store.blobs()}

    def entries(self) -> list[EntryInfo]:
        sizes = self._blob_sizes()
        return [i for i in (self.info(k, sizes) for k in self.entry_keys()) if i is not None]

    def resolve(self, prefix: str) -> str:
        matches = [k for k in self.entry_keys() if k.startswith(prefix)]
        if len(matches) != 1:
            raise CacheError(f"{'no' if not matches else 'more than one'} cache entry matches {prefix!r}; "
                             "see titan-cache ls")
        return matches[0]

    def verify(self, *, remove: bool) -> tuple[int, list[str], list[str], int]:
        """Re-hash every blob and authenticate every record of this user; returns (blobs checked,
        corrupt blob hashes, tampered things: unauthenticated records, planted links and files,
        other users' records counted as theirs). With remove, delete them and this user's
        entries that name a removed blob or record; another user's records are never judged
        with this user's key, so never removed (a record file named for a uid that does not own
        it is planted, and is)."""
        checked, bad = 0, []
        for blob in self.store.blobs():
            checked += 1
            if not self.store.blob_intact(blob.sha, max_size=MAX_BLOB_BYTES):
                bad.append(blob.sha)
        strays = self.store.strays()
        tampered = [f"{self.root / s} is not something titan makes (planted?)" for s in strays]
        unauthenticated, planted, others = [], [], 0
        for kind in RECORD_KINDS:
            for name in self.store.record_names(kind):
                record, why = self.store.record_state(kind, name)
                if record is None:
                    tampered.append(why)
                    unauthenticated.append((kind, name))
            for foreign in self.store.foreign_records(kind):
                if foreign.planted:
                    tampered.append(f"{kind}/{foreign.name}@{foreign.uid} is not owned by uid {foreign.uid} (planted?)")
                    planted.append((kind, foreign))
                else:
                    others += 1
        if remove:
            for s in strays:
                self.store.remove_stray(s)
            for kind, name in unauthenticated:
                self.store.remove_record(kind, name)
            for kind, foreign in planted:
                self.store.remove_foreign_record(kind, foreign)
            for sha in bad:
                self.store.remove_blob(sha)
            for key in self.entry_keys():
                if self.get_entry(key)[0] is None:
                    self._remove_entry(key)
        return checked, bad, tampered, others

    def _remove_entry(self, key: str) -> None:
        self.store.remove_record("entries", key)
        self.store.untouch(key)

    def gc(self, *, max_size: int | None, older_than_s: float | None, now: float | None = None) -> dict:
        """Remove this user's entries by age and/or until the cache fits max_size (least recently
        used first), never one whose build lock is held; then files past the grace period that
        no record names, this user's or another's."""
        now = time.time() if now is None else now
        removed, skipped = [], []
        infos = sorted(self.entries(), key=lambda i: i.last_used)
        total = self.size()
        for info in infos:
            too_old = older_than_s is not None and now - info.last_used > older_than_s
            too_big = max_size is not None and total > max_size
            if not (too_old or too_big):
                continue
            lock = self.store.lock(info.key)
            try:
                if not lock.acquire(blocking=False):
                    skipped.append(info.key)
                    continue
                total -= self._remove_entry_and_files(info)
                removed.append(info.key)
            finally:
                lock.release()
        self._sweep(now)
        return {"removed": removed, "skipped_locked": skipped, "size": self.size()}

    def _live(self) -> tuple[set[str], set[str]]:
        """Rank keys and blobs that some entry or rank record names."""
        live_ranks, live_blobs = set(), set()
        for key in self.entry_keys():
            entry = self.entry_record(key) or {}
            live_ranks.update(entry.get("ranks", []))
            live_blobs.update(self.program_blobs(entry))
        for rank_key in self.store.record_names("ranks"):
            record = self.rank_record(rank_key) or {}
            live_blobs.update(record.get(k) for k in RANK_BLOBS)
        live_blobs |= self.store.foreign_blob_refs()  # a teammate's builds keep theirs
        return live_ranks, live_blobs

    def _remove_entry_and_files(self, info: EntryInfo) -> int:
        """Remove an entry, its rank records, and the blobs no other entry or rank record
        names; returns bytes freed. A blob touched after the entry's last use is being reused
        by a build that has not committed yet: it stays (the sweep's grace period covers it)."""
        own = self.entry_blobs(info.entry)
        self._remove_entry(info.key)
        for rank_key in info.entry.get("ranks", []):
            self.store.remove_record("ranks", rank_key)
        _, live = self._live()
        freed = 0
        blobs = {b.sha: b for b in self.store.blobs()}
        for sha in own - live:
            blob = blobs.get(sha)
            if blob is not None and blob.mtime <= info.last_used + 1.0:
                freed += blob.size
                self.store.remove_blob(sha)
        return freed

    def _sweep(self, now: float) -> None:
        """Delete rank records and blobs no entry references, and stale temp files, past the
        grace period."""
        live_ranks, _ = self._live()
        for rank_key in self.store.record_names("ranks"):
            mtime = self.store.record_mtime("ranks", rank_key)
            if rank_key not in live_ranks and mtime is not None and now - mtime > UNREFERENCED_GRACE_S:
                self.store.remove_record("ranks", rank_key)
        live_blobs = set()
        for key in self.entry_keys():
            live_blobs.update(self.program_blobs(self.entry_record(key) or {}))
        for rank_key in live_ranks:
            record = self.rank_record(rank_key) or {}
            live_blobs.update(record.get(k) for k in RANK_BLOBS)
        live_blobs |= self.store.foreign_blob_refs()
        for blob in list(self.store.blobs()):
            if blob.sha not in live_blobs and now - blob.mtime > UNREFERENCED_GRACE_S:
                self.store.remove_blob(blob.sha)
        self.store.sweep_tmp(now=now, grace_s=UNREFERENCED_GRACE_S)

    def size(self) -> int:
        return self.store.size()


def cache_layout_problems(root: Path) -> list[str]:
    """Why a cache directory cannot be opened (planted links, owner, permissions), for verify."""
    return layout_problems(root, ("blobs", "used", "locks", "tmp", *RECORD_KINDS, KERNELS_DIR))


def remove_planted(root: Path) -> None:
    remove_planted_dirs(root, ("blobs", "used", "locks", "tmp", *RECORD_KINDS, KERNELS_DIR))

"""The content-addressed build cache shared by all jobs on a machine (or a shared filesystem).

    <root>/blobs/<aa>/<sha256>      graph blobs and rank metadata, named by content
    <root>/ranks/<rank key>.json    one traced rank: its factors and blob hashes
    <root>/entries/<key>.json       one build: factors, rank keys, manifest fields
    <root>/used/<key>               touched on every use (its mtime is the last use)
    <root>/locks/<key>.lock         held while a build of that key runs (filelock)
    <root>/tmp/                     files being written

Every file is written to tmp/ and renamed into place, and an entry is written only after
everything it names is in place, so a builder killed at any moment leaves at most unreferenced
blobs and temp files (gc removes them), never an entry that points at something missing.
Readers re-hash every blob they use.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import filelock

from titan.runtime.artifact import cache_root, file_sha256

# gc leaves unreferenced files younger than this alone: a running build may be about to commit them.
UNREFERENCED_GRACE_S = 600.0


class CacheError(ValueError):
    """The cache directory cannot be used; the message says why."""


@dataclass(frozen=True)
class EntryInfo:
    key: str
    entry: dict
    size: int
    last_used: float


class Cache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root).expanduser() if root else cache_root()
        for sub in ("blobs", "ranks", "entries", "used", "locks", "tmp"):
            try:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CacheError(f"cannot use cache directory {self.root}: {e.strerror}; "
                                 "pass --cache-dir or set TITAN_CACHE_DIR to a writable directory") from None

    # --- files ---------------------------------------------------------------------------
    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / sha[:2] / sha

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root / "tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
            raise CacheError(f"cannot write to the build cache {self.root}: {e.strerror or e}; free space there, "
                             "or pass --cache-dir (or TITAN_CACHE_DIR) with a writable directory") from None
        except BaseException:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
            raise

    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.blob_path(sha)
        try:
            intact = hashlib.sha256(path.read_bytes()).hexdigest() == sha
        except FileNotFoundError:
            intact = False
        if intact:
            os.utime(path)  # tell a concurrent gc this blob is in use
        else:
            self._write_atomic(path, data)  # new, or replacing a damaged copy
        return sha

    def read_blob(self, sha: str) -> bytes:
        """The blob's bytes; CacheError if it is missing or does not match its hash."""
        path = self.blob_path(sha)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CacheError(f"blob {sha[:12]} is missing") from None
        if hashlib.sha256(data).hexdigest() != sha:
            raise CacheError(f"blob {sha[:12]} is corrupt")
        return data

    def _read_json(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # only written by rename, so this is outside damage: treat as absent

    # --- ranks and entries ------------------------------------------------------------------
    def put_rank(self, rank_key: str, record: dict) -> None:
        self._write_atomic(self.root / "ranks" / f"{rank_key}.json", json.dumps(record, indent=1).encode())

    def get_rank(self, rank_key: str) -> dict | None:
        """A traced rank whose blobs are all present and intact, else None."""
        record = self._read_json(self.root / "ranks" / f"{rank_key}.json")
        if record is None:
            return None
        try:
            for sha in (record["forward"], record["backward"], record["meta"]):
                self.read_blob(sha)
        except (CacheError, KeyError):
            return None
        return record

    def put_entry(self, key: str, entry: dict) -> None:
        self._write_atomic(self.root / "entries" / f"{key}.json", json.dumps(entry, indent=1).encode())

    def get_entry(self, key: str) -> tuple[dict | None, str]:
        """(entry, '') when present and every blob verifies; else (None, why)."""
        entry = self._read_json(self.root / "entries" / f"{key}.json")
        if entry is None:
            return None, "no entry for this key"
        for rank_key in entry["ranks"]:
            record = self._read_json(self.root / "ranks" / f"{rank_key}.json")
            if record is None:
                return None, "an entry's rank record is missing"
            for sha in (record["forward"], record["backward"], record["meta"]):
                try:
                    self.read_blob(sha)
                except CacheError as e:
                    return None, f"the entry's {e}"
        return entry, ""

    def touch(self, key: str) -> None:
        path = self.root / "used" / key
        path.touch()
        os.utime(path)

    def lock(self, key: str, *, on_wait: Callable[[], None] | None = None) -> filelock.FileLock:
        """Exclusive lock for building `key`; calls on_wait once if another process holds it."""
        lock = filelock.FileLock(str(self.root / "locks" / f"{key}.lock"))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            if on_wait:
                on_wait()
            lock.acquire()
        return lock

    # --- listing, verification, gc ------------------------------------------------------------
    def entry_keys(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "entries").glob("*.json"))

    def entry_blobs(self, entry: dict) -> set[str]:
        shas = set()
        for rank_key in entry.get("ranks", []):
            record = self._read_json(self.root / "ranks" / f"{rank_key}.json") or {}
            shas.update(record.get(k) for k in ("forward", "backward", "meta") if record.get(k))
        return shas

    def info(self, key: str) -> EntryInfo | None:
        entry = self._read_json(self.root / "entries" / f"{key}.json")
        if entry is None:
            return None
        size = sum(self.blob_path(s).stat().st_size for s in self.entry_blobs(entry) if self.blob_path(s).exists())
        used = self.root / "used" / key
        last = used.stat().st_mtime if used.exists() else entry.get("created_ts", 0.0)
        return EntryInfo(key=key, entry=entry, size=size, last_used=last)

    def entries(self) -> list[EntryInfo]:
        return [i for i in (self.info(k) for k in self.entry_keys()) if i is not None]

    def resolve(self, prefix: str) -> str:
        matches = [k for k in self.entry_keys() if k.startswith(prefix)]
        if len(matches) != 1:
            raise CacheError(f"{'no' if not matches else 'more than one'} cache entry matches {prefix!r}; "
                             "see titan-cache ls")
        return matches[0]

    def verify(self, *, remove: bool) -> tuple[int, list[str]]:
        """Re-hash every blob; returns (blobs checked, corrupt blob hashes). With remove, delete
        corrupt blobs and the entries and rank records that name them."""
        checked, bad = 0, []
        for path in sorted((self.root / "blobs").glob("*/*")):
            checked += 1
            if file_sha256(path) != path.name:
                bad.append(path.name)
        if remove and bad:
            bad_set = set(bad)
            for sha in bad:
                self.blob_path(sha).unlink(missing_ok=True)
            for path in (self.root / "ranks").glob("*.json"):
                record = self._read_json(path) or {}
                if bad_set & {record.get(k) for k in ("forward", "backward", "meta")}:
                    path.unlink(missing_ok=True)
            for key in self.entry_keys():
                if self.get_entry(key)[0] is None:
                    self._remove_entry(key)
        return checked, bad

    def _remove_entry(self, key: str) -> None:
        (self.root / "entries" / f"{key}.json").unlink(missing_ok=True)
        (self.root / "used" / key).unlink(missing_ok=True)

    def gc(self, *, max_size: int | None, older_than_s: float | None, now: float | None = None) -> dict:
        """Remove entries by age and/or until the cache fits max_size (least recently used first),
        never one whose build lock is held; then unreferenced files past the grace period."""
        now = time.time() if now is None else now
        removed, skipped = [], []
        infos = sorted(self.entries(), key=lambda i: i.last_used)
        total = self.size()
        for info in infos:
            too_old = older_than_s is not None and now - info.last_used > older_than_s
            too_big = max_size is not None and total > max_size
            if not (too_old or too_big):
                continue
            lock = filelock.FileLock(str(self.root / "locks" / f"{info.key}.lock"))
            try:
                lock.acquire(timeout=0)
            except filelock.Timeout:
                skipped.append(info.key)
                continue
            try:
                total -= self._remove_entry_and_files(info)
                removed.append(info.key)
            finally:
                lock.release()
        self._sweep(now)
        return {"removed": removed, "skipped_locked": skipped, "size": self.size()}

    def _remove_entry_and_files(self, info: EntryInfo) -> int:
        """Remove an entry, its rank records, and the blobs no other entry or rank record
        names; returns bytes freed. A blob touched after the entry's last use is being reused
        by a build that has not committed yet: it stays (the sweep's grace period covers it)."""
        own = self.entry_blobs(info.entry)
        self._remove_entry(info.key)
        for rank_key in info.entry.get("ranks", []):
            (self.root / "ranks" / f"{rank_key}.json").unlink(missing_ok=True)
        live = set()
        for key in self.entry_keys():
            live.update(self.entry_blobs(self._read_json(self.root / "entries" / f"{key}.json") or {}))
        for path in (self.root / "ranks").glob("*.json"):
            record = self._read_json(path) or {}
            live.update(record.get(k) for k in ("forward", "backward", "meta"))
        freed = 0
        for sha in own - live:
            path = self.blob_path(sha)
            if path.exists() and path.stat().st_mtime <= info.last_used + 1.0:
                freed += path.stat().st_size
                path.unlink()
        return freed

    def _sweep(self, now: float) -> int:
        """Delete rank records and blobs no entry references, and stale temp files, past the
        grace period; returns bytes freed."""
        live_ranks, live_blobs = set(), set()
        for key in self.entry_keys():
            entry = self._read_json(self.root / "entries" / f"{key}.json") or {}
            live_ranks.update(entry.get("ranks", []))
            live_blobs.update(self.entry_blobs(entry))
        freed = 0
        for path in (self.root / "ranks").glob("*.json"):
            if path.stem not in live_ranks and now - path.stat().st_mtime > UNREFERENCED_GRACE_S:
                path.unlink(missing_ok=True)
        for path in (self.root / "blobs").glob("*/*"):
            if path.name not in live_blobs and now - path.stat().st_mtime > UNREFERENCED_GRACE_S:
                freed += path.stat().st_size
                path.unlink(missing_ok=True)
        for path in (self.root / "tmp").iterdir():
            if now - path.stat().st_mtime > UNREFERENCED_GRACE_S:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        return freed

    def size(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "blobs").glob("*/*"))

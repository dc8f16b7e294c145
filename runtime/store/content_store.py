"""One content store for everything titan caches: the build cache (runtime/store/build_cache.py) and the
compiled kernels (runtime/store/kernel_store.py) are each one of these. Torch-free.

    <root>/blobs/<aa>/<sha256>     bytes, named by their content; every read re-hashes them
    <root>/<kind>/<name>@<uid>.json  records (what a blob means), each authenticated with its
                                   user's key (below); a record that does not verify is absent
    <root>/used/<name>@<uid>       markers whose mtime is a last use (for gc)
    <root>/locks/<name>@<uid>.lock flock()ed while one of the user's processes produces <name>
    <root>/tmp/                    files being written, renamed into place when complete

Trust (docs/trust.md): a blob is only ever reached through its digest, and a digest only
from an authenticated record (or an artifact's manifest), so whoever can write the directory
can delete or spoil entries (a rebuild follows) but cannot make titan serve bytes the user's
own titan did not record. Records carry an HMAC-SHA256 with a per-user key kept outside the
store ($TITAN_KEY_FILE, default ~/.config/titan/cache.key, mode 0600, created on first use),
as ssh keeps its identity outside what it connects to.

Every operation goes through directory descriptors opened without following symbolic links,
so nothing planted in the store (a link for a sub-directory, a lock, a marker or a blob) can
steer a write or a delete outside it; a sub-directory that is not a plain directory made by
this user is refused. By default the store must also be private (owned by the user, not
writable by group or others, as ssh demands of ~/.ssh); TITAN_SHARED_CACHE=1 opts in to a
directory others may write, which the record authentication above makes safe to read. Records,
markers and locks are per user (runtime/store/record.py): in a shared store, maintenance keeps
whatever another user's records name (docs/trust.md, "Shared caches").
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from titan.runtime.common.safe_files import UnsafeFile, open_dir_below, read_regular_at
from titan.runtime.store.record import (MAX_RECORD_BYTES, decode_record, encode_record, owned_name,
                                        read_unauthenticated, split_owned_name)
from titan.runtime.store.lock import StoreLock, unlink_planted
from titan.runtime.common.abandoned_temps import is_abandoned, owner_tag

SHARED_ENV = "TITAN_SHARED_CACHE"
SHA256 = re.compile(r"[0-9a-f]{64}")
NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")
COMMON_DIRS = ("blobs", "used", "locks", "tmp")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


class StoreError(ValueError):
    """The store cannot be used as it is; the message says why and how to fix it."""


def shared_opt_in() -> bool:
    return os.environ.get(SHARED_ENV, "") == "1"


def _dir_problem(st: os.stat_result, shared: bool) -> str:
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if shared:
        return ""
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not you"
    if st.st_mode & 0o022:
        return "is writable by group or others"
    return ""


def _dir_fix(path: Path) -> str:
    return (f"run chmod go-w {path} if only you use it, set {SHARED_ENV}=1 to share it with others "
            "(records stay authenticated per user), or pass --cache-dir (or TITAN_CACHE_DIR) with a private directory")


@dataclass(frozen=True)
class ForeignRecord:
    """A record file in a store that is not this user's: another user's (named with their uid and
    owned by them; `record` is its unauthenticated content, or None if it does not parse), or
    planted (`planted`: its owner is not the uid in its name)."""
    name: str
    uid: int
    planted: bool
    record: dict | None


@dataclass(frozen=True)
class Blob:
    sha: str
    size: int
    mtime: float


def _planted_kind(dir_fd: int, name: str, error: OSError) -> str:
    """What stands where a directory should be (open(O_DIRECTORY | O_NOFOLLOW) says ENOTDIR for a link)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return f"cannot be opened ({error.strerror})"
    return "is a symbolic link" if stat.S_ISLNK(mode) else "is not a directory" if not stat.S_ISDIR(mode) \
        else f"cannot be opened ({error.strerror})"


class ContentStore:
    """Blobs by content, authenticated records by name, markers, locks; see the module docstring.
    `record_kinds` are the record directories this store keeps (e.g. "ranks", "entries")."""

    def __init__(self, root: Path, *, record_kinds: tuple[str, ...], extra_dirs: tuple[str, ...] = (),
                 titan_made_root: bool = False):
        self.root = Path(root).expanduser()
        self.shared = shared_opt_in()
        self.uid = os.geteuid()
        self.record_kinds = record_kinds
        self.expected_dirs = COMMON_DIRS + record_kinds + extra_dirs
        self._mode = 0o2775 if self.shared else 0o755
        self._fds: dict[str, int] = {}
        self._root_fd = -1
        self._swept = False
        try:
            if titan_made_root:  # a directory titan makes inside another store: never a link
                self._mkdir_path(self.root.parent)
                parent = os.open(self.root.parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
                try:
                    self._root_fd = self._subdir(parent, self.root.name, self.root)
                finally:
                    os.close(parent)
            else:  # the directory the user chose (it may be a link the user made)
                self._mkdir_path(self.root)
                self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError as e:
            raise StoreError(f"cannot use cache directory {self.root}: {e.strerror or e}; pass --cache-dir "
                             "or set TITAN_CACHE_DIR to a writable directory") from None
        self._check(self._root_fd, self.root)
        for sub in COMMON_DIRS + record_kinds:
            self._fds[sub] = self._subdir(self._root_fd, sub, self.root / sub)
        for sub in extra_dirs:  # kept by another store: checked here, never opened through a link
            try:
                st = os.stat(sub, dir_fd=self._root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                what = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
                raise StoreError(f"{self.root / sub} {what}, which titan never makes (planted?): remove it, or run "
                                 "titan-cache verify --remove")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def __del__(self):
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    # --- directories ------------------------------------------------------------------------
    def _group_writable(self, fd: int) -> None:
        """In a shared store, a directory this user made is made group-writable and setgid (files
        in it take its group) explicitly: mkdir's mode is cut by the umask (022 by default)."""
        if self.shared and os.fstat(fd).st_uid == self.uid:
            os.chmod(fd, self._mode)

    def _mkdir_path(self, path: Path) -> None:
        if path.is_dir():
            return
        self._mkdir_path(path.parent)
        try:
            os.mkdir(path, self._mode)
        except FileExistsError:
            return
        if self.shared:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
            try:
                self._group_writable(fd)
            finally:
                os.close(fd)

    def _check(self, fd: int, path: Path) -> None:
        problem = _dir_problem(os.fstat(fd), self.shared)
        if problem:
            raise StoreError(f"the cache directory {path} {problem}; {_dir_fix(path)}")

    def _subdir(self, parent_fd: int, name: str, path: Path, *, create: bool = True) -> int:
        created = False
        if create:
            try:
                os.mkdir(name, self._mode, dir_fd=parent_fd)
                created = True
            except FileExistsError:
                pass
            except OSError as e:
                raise StoreError(f"cannot create {path}: {e.strerror or e}; free space there or pass --cache-dir "
                                 "with a writable directory") from None
        try:
            fd = os.open(name, _DIR, dir_fd=parent_fd)
        except OSError as e:
            what = _planted_kind(parent_fd, name, e)
            raise StoreError(f"{path} {what}, which titan never makes (planted?): remove it, or run "
                             f"titan-cache verify --remove") from None
        try:
            self._check(fd, path)
            if created:
                self._group_writable(fd)
        except (StoreError, OSError) as e:
            os.close(fd)
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"cannot make {path} group-writable: {e.strerror or e}; pass --cache-dir "
                             "with a writable directory") from None
        return fd

    def _blob_dir(self, sha: str, *, create: bool) -> int | None:
        try:
            return self._subdir(self._fds["blobs"], sha[:2], self.root / "blobs" / sha[:2], create=create)
        except StoreError:
            if not create and not os.path.lexists(self.root / "blobs" / sha[:2]):
                return None
            raise

    # --- writing ------------------------------------------------------------------------------
    def _write(self, dir_fd: int, name: str, data: bytes, *, mode: int | None = None) -> None:
        """Write `data` to a new file in tmp/ and rename it to `name` in `dir_fd`: readers see the
        old file or the whole new one, and a link planted at `name` is replaced, not followed."""
        tmp_fd = self._fds["tmp"]
        if not self._swept:  # once per store opened: what killed writers left (abandoned_temps.py)
            self._remove_abandoned_tmp()
        tmp = f"{name}.{owner_tag()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                         (0o664 if self.shared else 0o644) if mode is None else mode, dir_fd=tmp_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=tmp_fd)
            except OSError:
                pass
            raise StoreError(f"cannot write to {self.root}: {e.strerror or e}; free space there, or pass --cache-dir "
                             "(or TITAN_CACHE_DIR) with a writable directory") from None
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=tmp_fd)
            except OSError:
                pass
            raise

    # --- blobs ----------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        dir_fd = self._blob_dir(sha, create=True)
        try:
            try:
                read_regular_at(dir_fd, sha, max_size=len(data), what="blob", sha256=sha)
                os.utime(sha, dir_fd=dir_fd, follow_symlinks=False)  # in use: a concurrent gc leaves it
            except (UnsafeFile, OSError):
                self._write(dir_fd, sha, data)  # new, or replacing a damaged or planted copy
        finally:
            os.close(dir_fd)
        return sha

    def read_blob(self, sha: str, *, max_size: int, what: str = "blob") -> bytes:
        """The blob's bytes, hashed as read; StoreError if missing, not a plain file, too large
        or not matching its name."""
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):
            raise StoreError(f"{what} {sha!r} is not a sha256 digest")
        dir_fd = self._blob_dir(sha, create=False)
        if dir_fd is None:
            raise StoreError(f"{what} {sha[:12]} is missing")
        try:
            return read_regular_at(dir_fd, sha, max_size=max_size, what=f"{what} {sha[:12]}", sha256=sha)
        except UnsafeFile as e:
            raise StoreError(str(e)) from None
        finally:
            os.close(dir_fd)

    def blob_intact(self, sha: str, *, max_size: int) -> bool:
        try:
            self.read_blob(sha, max_size=max_size)
            return True
        except StoreError:
            return False

    def remove_blob(self, sha: str) -> None:
        try:
            dir_fd = self._blob_dir(sha, create=False)
        except StoreError:
            return  # its directory is not one titan made: verify reports it, nothing is deleted through it
        if dir_fd is not None:
            try:
                os.unlink(sha, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            finally:
                os.close(dir_fd)

    def blobs(self, strays: list[str] | None = None) -> Iterator[Blob]:
        """Every blob file; anything else under blobs/ is reported into `strays` (never followed)."""
        with os.scandir(self._fds["blobs"]) as top:
            prefixes = sorted(top, key=lambda e: e.name)
            for d in prefixes:
                if not (d.is_dir(follow_symlinks=False) and re.fullmatch(r"[0-9a-f]{2}", d.name)):
                    if strays is not None:
                        strays.append(f"blobs/{d.name}")
                    continue
                try:
                    fd = open_dir_below(self._fds["blobs"], [d.name])
                except OSError:
                    continue  # replaced meanwhile
                try:
                    with os.scandir(fd) as inner:
                        for f in sorted(inner, key=lambda e: e.name):
                            st = f.stat(follow_symlinks=False)
                            if stat.S_ISREG(st.st_mode) and SHA256.fullmatch(f.name) and f.name[:2] == d.name:
                                yield Blob(f.name, st.st_size, st.st_mtime)
                            elif strays is not None:
                                strays.append(f"blobs/{d.name}/{f.name}")
                finally:
                    os.close(fd)

    def size(self) -> int:
        return sum(b.size for b in self.blobs())

    # --- records --------------------------------------------------------------------------------
    def _record_file(self, name: str) -> str:
        return f"{owned_name(name, self.uid)}.json"

    def put_record(self, kind: str, name: str, record: dict) -> None:
        assert NAME.fullmatch(name), name
        # 0644 even in a shared store: teammates read a record; only its owner may change it.
        self._write(self._fds[kind], self._record_file(name), encode_record(kind, name, record), mode=0o644)

    def record_state(self, kind: str, name: str) -> tuple[dict | None, str]:
        """(record, '') when present and authenticated; else (None, why). The file is bounded
        before it is read and authenticated before it is parsed."""
        if not NAME.fullmatch(name):
            return None, "not a record name"
        try:
            data = read_regular_at(self._fds[kind], self._record_file(name), max_size=MAX_RECORD_BYTES,
                                   what=f"{kind}/{name}")
        except UnsafeFile as e:
            return None, "missing" if "is missing" in str(e) else str(e)
        return decode_record(kind, name, data, f"{kind}/{name}")

    def get_record(self, kind: str, name: str) -> dict | None:
        return self.record_state(kind, name)[0]

    def record_names(self, kind: str, strays: list[str] | None = None) -> list[str]:
        """This user's record names; other users' records are skipped (foreign_records lists
        them) and anything titan does not make goes to `strays`."""
        names = []
        with os.scandir(self._fds[kind]) as it:
            for e in it:
                owned = split_owned_name(e.name[:-5]) if e.name.endswith(".json") else None
                if owned and e.is_file(follow_symlinks=False):
                    if owned[1] == self.uid:
                        names.append(owned[0])
                elif strays is not None:
                    strays.append(f"{kind}/{e.name}")
        return sorted(names)

    def foreign_records(self, kind: str) -> Iterator[ForeignRecord]:
        """The record files of `kind` named for other users (see ForeignRecord)."""
        with os.scandir(self._fds[kind]) as it:
            files = sorted(e.name for e in it if e.name.endswith(".json") and e.is_file(follow_symlinks=False))
        for file in files:
            owned = split_owned_name(file[:-5])
            if owned is None or owned[1] == self.uid:
                continue
            try:
                fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=self._fds[kind])
            except OSError:
                continue  # removed meanwhile, or unreadable: nothing to keep for it
            try:
                planted = os.fstat(fd).st_uid != owned[1]
            finally:
                os.close(fd)
            record = None
            if not planted:
                try:
                    data = read_regular_at(self._fds[kind], file, max_size=MAX_RECORD_BYTES, what=f"{kind}/{file}")
                    record = read_unauthenticated(data, f"{kind}/{file}")
                except UnsafeFile:
                    pass
            yield ForeignRecord(name=owned[0], uid=owned[1], planted=planted, record=record)

    def foreign_blob_refs(self) -> set[str]:
        """Every sha256 that another user's record of any kind names: what this user's
        maintenance must keep (their records cannot be authenticated here, so they are read
        conservatively: any digest anywhere in them counts)."""
        refs: set[str] = set()
        for kind in self.record_kinds:
            for foreign in self.foreign_records(kind):
                stack = [foreign.record] if foreign.record is not None else []
                while stack:
                    value = stack.pop()
                    if isinstance(value, dict):
                        stack.extend(value.values())
                    elif isinstance(value, list):
                        stack.extend(value)
                    elif isinstance(value, str) and SHA256.fullmatch(value):
                        refs.add(value)
        return refs

    def record_mtime(self, kind: str, name: str) -> float | None:
        try:
            st = os.stat(self._record_file(name), dir_fd=self._fds[kind], follow_symlinks=False)
        except OSError:
            return None
        return st.st_mtime if stat.S_ISREG(st.st_mode) else None

    def remove_record(self, kind: str, name: str) -> None:
        try:
            os.unlink(self._record_file(name), dir_fd=self._fds[kind])
        except FileNotFoundError:
            pass

    def remove_foreign_record(self, kind: str, record: ForeignRecord) -> None:
        """Remove a planted record file (never another user's own: see ForeignRecord)."""
        assert record.planted
        try:
            os.unlink(f"{owned_name(record.name, record.uid)}.json", dir_fd=self._fds[kind])
        except OSError:
            pass

    def remove_stray(self, rel: str) -> None:
        """Remove something strays() reported (root-relative), never following a link."""
        parts = rel.split("/")
        try:
            fd = open_dir_below(self._root_fd, parts[:-1])
        except OSError:
            return
        try:
            unlink_planted(fd, parts[-1])
        except OSError:
            pass  # a non-empty planted directory: reported, left for the user
        finally:
            os.close(fd)

    # --- markers, locks, temp files -----------------------------------------------------------
    def touch(self, name: str) -> None:
        """Mark `name` used now (used/<name>): a planted link or FIFO there is replaced, never followed."""
        fd_dir, name = self._fds["used"], owned_name(name, self.uid)
        for _ in range(2):
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, 0o644,
                             dir_fd=fd_dir)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise StoreError(f"cannot write to {self.root}: {e.strerror or e}; free space there or pass "
                                     "--cache-dir with a writable directory") from None
                unlink_planted(fd_dir, name)
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.utime(fd)
                    return
            finally:
                os.close(fd)
            unlink_planted(fd_dir, name)

    def last_used(self, name: str) -> float | None:
        try:
            st = os.stat(owned_name(name, self.uid), dir_fd=self._fds["used"], follow_symlinks=False)
        except OSError:
            return None
        return st.st_mtime if stat.S_ISREG(st.st_mode) else None

    def untouch(self, name: str) -> None:
        try:
            os.unlink(owned_name(name, self.uid), dir_fd=self._fds["used"])
        except FileNotFoundError:
            pass

    def lock(self, name: str) -> StoreLock:
        return StoreLock(self._fds["locks"], f"{owned_name(name, self.uid)}.lock")

    def _remove_abandoned_tmp(self) -> None:
        self._swept = True
        with os.scandir(self._fds["tmp"]) as it:
            for e in it:
                if is_abandoned(e.name):
                    try:
                        unlink_planted(self._fds["tmp"], e.name)
                    except OSError:
                        pass

    def sweep_tmp(self, *, now: float, grace_s: float) -> None:
        """Remove temp files left by killed writers (older than grace_s)."""
        with os.scandir(self._fds["tmp"]) as it:
            for e in it:
                try:
                    if now - e.stat(follow_symlinks=False).st_mtime > grace_s:
                        unlink_planted(self._fds["tmp"], e.name)
                except OSError:
                    pass

    # --- tampering --------------------------------------------------------------------------------
    def strays(self) -> list[str]:
        """Entries in the store that titan does not make (links, FIFOs, odd names), by relative path."""
        out: list[str] = []
        with os.scandir(self._root_fd) as it:
            for e in it:
                if e.name in self.expected_dirs and e.is_dir(follow_symlinks=False):
                    continue
                if e.name in self.expected_dirs or e.is_symlink():
                    out.append(e.name)
        for _ in self.blobs(out):
            pass
        for kind in self.record_kinds:
            self.record_names(kind, out)
        for kind in ("used", "locks"):
            with os.scandir(self._fds[kind]) as it:
                out.extend(f"{kind}/{e.name}" for e in it if not e.is_file(follow_symlinks=False))
        return out


def layout_problems(root: Path, expected_dirs: tuple[str, ...]) -> list[str]:
    """What stops a store at `root` from opening (links or other things in place of its
    directories, wrong owner or permissions), without opening it: for titan-cache verify."""
    out = []
    shared = shared_opt_in()
    for sub in ("",) + expected_dirs:
        path = root / sub if sub else root
        try:
            st = os.stat(path, follow_symlinks=not sub)
        except FileNotFoundError:
            continue
        except OSError as e:
            if not sub:  # the directory given cannot be a store at all: a user error, not tampering
                raise StoreError(f"cannot use cache directory {root}: {e.strerror or e}; pass --cache-dir or set "
                                 "TITAN_CACHE_DIR to a writable directory") from None
            out.append(f"{path}: {e.strerror}")
            continue
        if stat.S_ISLNK(st.st_mode):
            out.append(f"{path} is a symbolic link")
            continue
        problem = _dir_problem(st, shared)
        if problem:
            out.append(f"{path} {problem}")
    return out


def remove_planted_dirs(root: Path, expected_dirs: tuple[str, ...]) -> None:
    """Unlink links and other non-directories found where a store keeps its directories."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError:
        return
    try:
        for sub in expected_dirs:
            try:
                st = os.stat(sub, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                unlink_planted(fd, sub)
    finally:
        os.close(fd)

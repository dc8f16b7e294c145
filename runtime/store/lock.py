"""An exclusive lock file in a store's locks/ directory, opened without following links: one
process produces a key (a build, a kernel) while the others wait and then reuse it. Waits are
bounded and name the holder (issue 29: any writer of a shared cache could hold a key's lock
and make titan-build wait for ever)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from typing import Callable

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LockError(ValueError):
    """The lock cannot be created."""


def unlink_planted(dir_fd: int, name: str) -> None:
    """Remove a directory entry that is not what titan makes (a link, FIFO, ...): unlink never
    follows a link, and a planted directory is removed only if empty."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except IsADirectoryError:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


LOCK_WAIT_ENV = "TITAN_LOCK_WAIT"
DEFAULT_LOCK_WAIT_S = 1800.0
"""How long a process waits for another to produce what it needs (a build of 405B at 1,024 ranks
takes under 3 minutes here) before it goes on without the lock: the lock only saves doing the
work twice (every write is atomic and every record authenticated), so no holder, stuck or
hostile, can make a build wait for ever."""
_POLL_S = 0.5


def lock_wait_s() -> float:
    text = os.environ.get(LOCK_WAIT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_LOCK_WAIT_S
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise LockError(f"{LOCK_WAIT_ENV}={text!r}: give the longest wait for a cache lock in seconds, e.g. 600")
    return value


def lock_holder(fd: int) -> str:
    """Who holds the flock on `fd`, from /proc/locks (what the kernel says, not what the holder
    wrote): 'pid 123 (titan-build, user alice)', or why it cannot be named."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read(1 << 22).splitlines()
    except OSError:
        return "a process this system does not name (no /proc/locks)"
    pids = []
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6:
            continue  # a waiter, not a holder
        if fields[5] == dev or fields[5].rsplit(":", 1)[-1] == str(st.st_ino):
            pids.append(fields[4])
    if not pids or not pids[0].isdigit() or pids[0] == "0":
        return "a process on another host or outside this process namespace"
    pid = pids[0]
    try:
        comm = open(f"/proc/{pid}/comm").read(64).strip()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return f"pid {pid}"
    try:
        import pwd
        user = pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        user = f"uid {uid}"
    return f"pid {pid} ({comm.encode('unicode_escape').decode()}, user {user})"


class StoreLock:
    """An exclusive flock on <store>/locks/<name>.lock, opened without following links. A lock
    file that is not this user's (the name carries the user's uid: store_record.py) is planted:
    it is replaced, or, where the directory forbids that (a sticky bit), locked read-only."""

    def __init__(self, locks_fd: int, name: str):
        self._fd = -1
        self.name = name
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
        for _ in range(2):
            try:
                fd = os.open(name, flags, 0o644, dir_fd=locks_fd)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EPERM):  # another user's file, not writable to us
                    fd = self._replace_or_read(locks_fd, name)
                    if fd >= 0:
                        self._fd = fd
                        return
                    continue
                if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise
            else:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    self._fd = fd
                    return
                os.close(fd)
                if stat.S_ISREG(st.st_mode):  # another user's, writable to us: replace it
                    fd = self._replace_or_read(locks_fd, name)
                    if fd >= 0:
                        self._fd = fd
                        return
                    continue
            unlink_planted(locks_fd, name)  # something planted where the lock goes: not ours, drop it
        raise LockError(f"cannot create the lock {name}: something keeps replacing it")

    @staticmethod
    def _replace_or_read(locks_fd: int, name: str) -> int:
        """Unlink another user's lock file and make ours; where that is not allowed, open theirs
        read-only (flock works on it; a holder is then waited for, at most lock_wait_s)."""
        try:
            os.unlink(name, dir_fd=locks_fd)
        except FileNotFoundError:
            pass
        except OSError:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=locks_fd)
            except OSError:
                return -1
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            return -1
        try:
            return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o644, dir_fd=locks_fd)
        except FileExistsError:
            return -1

    def acquire(self, *, blocking: bool, on_wait: Callable[[str], None] | None = None,
                on_give_up: Callable[[str, float], None] | None = None) -> bool:
        """Take the lock. Not blocking: False if held. Blocking: wait for it, calling on_wait(holder)
        once, for at most lock_wait_s(); then call on_give_up(holder, waited_s) and return False
        (the caller goes on without the lock)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not blocking:
                return False
        limit = lock_wait_s()
        if on_wait:
            on_wait(lock_holder(self._fd))
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            time.sleep(min(_POLL_S, max(0.0, limit - (time.monotonic() - t0))))
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
        if on_give_up:
            on_give_up(lock_holder(self._fd), time.monotonic() - t0)
        return False

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

"""An exclusive lock file in a store's locks/ directory, opened without following links: one
process produces a key (a build, a kernel) while the others wait and then reuse it."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
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


class StoreLock:
    """An exclusive flock on <store>/locks/<name>.lock, opened without following links."""

    def __init__(self, locks_fd: int, name: str):
        self._fd = -1
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
        for _ in range(2):
            try:
                fd = os.open(name, flags, 0o644, dir_fd=locks_fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise
            else:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    self._fd = fd
                    return
                os.close(fd)
            unlink_planted(locks_fd, name)  # something planted where the lock goes: not ours, drop it
        raise LockError(f"cannot create the lock {name}: something keeps replacing it")

    def acquire(self, *, blocking: bool, on_wait: Callable[[], None] | None = None) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not blocking:
                return False
        if on_wait:
            on_wait()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return True

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

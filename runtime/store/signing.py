"""Authenticating cache records: an HMAC-SHA256 with a per-user key kept outside any cache
($TITAN_KEY_FILE, default ~/.config/titan/cache.key, mode 0600, created on first use), as ssh
keeps its identity outside what it connects to. Writer and reader of a record are the same user,
so one secret file is enough: no key distribution, nothing to revoke."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

KEY_FILE_ENV = "TITAN_KEY_FILE"
RECORD_FORMAT = "titan-record-v2"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class KeyFileError(ValueError):
    """The signing key cannot be used; the message says how to fix it."""


def key_file() -> Path:
    return Path(os.environ.get(KEY_FILE_ENV) or "~/.config/titan/cache.key").expanduser()


_KEYS: dict[str, bytes] = {}


def user_key() -> bytes:
    """This user's record-signing key: created (0600) on first use, refused if others could
    read or replace it."""
    path = key_file()
    if str(path) in _KEYS:
        return _KEYS[str(path)]
    fix = f"set {KEY_FILE_ENV} to a file only you can read and write"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        except FileExistsError:
            pass
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    except OSError as e:
        raise KeyFileError(f"cannot use the cache signing key {path}: {e.strerror or e}; {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise KeyFileError(f"the cache signing key {path} must be a regular file owned by you with mode 0600 "
                             f"(run: chmod 600 {path}), or {fix}")
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise KeyFileError(f"the cache signing key {path} is malformed; delete it (a new one is made) or {fix}")
    _KEYS[str(path)] = bytes.fromhex(text)
    return _KEYS[str(path)]


def record_mac(kind: str, name: str, body: bytes) -> str:
    """The MAC of a record's raw bytes (its place is part of what is signed: a valid record moved
    to another name is not valid). Computed on bytes, so that a reader authenticates a record
    before anything parses it."""
    return hmac.new(user_key(), b"\0".join((RECORD_FORMAT.encode(), kind.encode(), name.encode(), body)),
                    hashlib.sha256).hexdigest()


def authentic(kind: str, name: str, body: bytes, mac: str) -> bool:
    return hmac.compare_digest(record_mac(kind, name, body), mac)

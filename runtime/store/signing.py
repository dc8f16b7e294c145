"""Authenticating cache records: an HMAC-SHA256 with a per-user key kept outside any cache
($TITAN_KEY_FILE, default ~/.config/titan/cache.key, mode 0600, created on first use), as ssh
keeps its identity outside what it connects to. Writer and reader of a record are the same user,
so one secret file is enough: no key distribution, nothing to revoke. The same MAC signs an
artifact's manifest with a key file the user names (titan-build --sign, titan-run --trust:
runtime/kernels/artifact_trust.py)."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

from titan.runtime.common.environment import KEY_FILE_ENV, key_file  # noqa: F401 (re-exported)

RECORD_FORMAT = "titan-record-v2"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class KeyFileError(ValueError):
    """The signing key cannot be used; the message says how to fix it."""


_KEYS: dict[str, bytes] = {}


def user_key() -> bytes:
    """This user's record-signing key: created (0600) on first use, refused if others could
    read or replace it."""
    return load_key(key_file(), create=True, what="the cache signing key",
                    fix=f"set {KEY_FILE_ENV} to a file only you can read and write")


def new_key(path: Path) -> bool:
    """Make a key file at `path` (0600) unless one is there; True if it was made."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return True


def load_key(path: Path, *, create: bool, what: str, fix: str) -> bytes:
    """The key in `path` (64 hex digits; made first when `create`), refused unless it is a
    regular file owned by the user that no one else can read: a key others can read signs for
    them too. KeyFileError says how to fix it."""
    path = Path(path).expanduser()
    if str(path) in _KEYS:
        return _KEYS[str(path)]
    try:
        if create:
            new_key(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    except OSError as e:
        raise KeyFileError(f"cannot use {what} {path}: {e.strerror or e}; {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise KeyFileError(f"{what} {path} must be a regular file owned by you with mode 0600 "
                               f"(run: chmod 600 {path}), or {fix}")
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise KeyFileError(f"{what} {path} is malformed (it holds 64 hex digits); "
                           + ("delete it (a new one is made) or " if create else "") + fix)
    _KEYS[str(path)] = bytes.fromhex(text)
    return _KEYS[str(path)]


def key_id(key: bytes) -> str:
    """A name for a key that reveals nothing of it: what titan-show prints as an artifact's signer."""
    return hashlib.sha256(b"titan-key-id\0" + key).hexdigest()[:16]


def mac(key: bytes, kind: str, name: str, body: bytes) -> str:
    """HMAC-SHA256 of `body` as a `kind` named `name`: the one signing mechanism (cache records,
    artifact manifests); kind and name are signed with it, so a MAC is valid in one place only.
    Computed on raw bytes, so that a reader authenticates them before anything parses them."""
    return hmac.new(key, b"\0".join((RECORD_FORMAT.encode(), kind.encode(), name.encode(), body)),
                    hashlib.sha256).hexdigest()


def record_mac(kind: str, name: str, body: bytes) -> str:
    """The MAC of a record's raw bytes with this user's key (its place is part of what is
    signed: a valid record moved to another name is not valid)."""
    return mac(user_key(), kind, name, body)


def authentic(kind: str, name: str, body: bytes, mac_: str) -> bool:
    return hmac.compare_digest(record_mac(kind, name, body), mac_)

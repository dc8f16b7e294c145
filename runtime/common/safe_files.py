"""Reading untrusted files without being steered: regular files only, never through a symbolic
link below the directory the caller chose, sized before and hashed while they are read, and
JSON documents bounded in size and nesting. Shared by the artifact reader and the content store;
imports no torch.

Why each rule: a FIFO among an artifact's files would hang the reader on open or read; a link to
a device file (/dev/zero) never ends; a directory or a /proc file is not a document; reading a
whole file before hashing it lets a huge one take all memory; and a deeply nested document
exhausts the parser's stack (RecursionError) instead of failing with a message.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 << 20
"""Largest JSON document (manifest, rank record, cache record) read: real ones are under 1 MiB."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of a JSON document: titan writes at most 6 levels."""
JSON_BYTES_PER_CONTAINER = 16
JSON_BYTES_PER_STRING = 8
"""A JSON document has at most one list or object per this many bytes, and one string per
JSON_BYTES_PER_STRING: counted on the raw bytes, before parsing, since a parsed container
costs 60-250 bytes of Python objects (a 60 MiB manifest of `[],` took 3.1 GiB). titan's
documents have 59-540 bytes per container and 20-48 per string (manifests, program
metadata, cache records of DeepSeek-V3 debug to 671B), and a document within both bounds
parses into at most ~10x its size."""
CHUNK = 1 << 20

# Open flags for reading something untrusted: no link followed at the last step, no wait on a
# FIFO's writer, no controlling terminal.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeFile(ValueError):
    """A file is not a plain readable file of a sane size, or does not hold what it must."""


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symbolic link"
    if e.errno == errno.ENOTDIR:
        return "has a path component that is not a directory"
    if e.errno == errno.ENOENT:
        return "is missing"
    if e.errno == errno.EACCES or e.errno == errno.EPERM:
        return "is not readable (permission denied)"
    return f"cannot be read ({e.strerror or e})"


def open_dir_below(root_fd: int, parts: list[str]) -> int:
    """A descriptor of root/parts..., refusing a symbolic link at every step. The caller closes it."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_fd(fd: int, *, max_size: int, what: str, sha256: str | None) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{what} is not a regular file")
    if st.st_size > max_size:
        raise UnsafeFile(f"{what} is {st.st_size:,} bytes, over the bound of {max_size:,}")
    h, chunks, total = hashlib.sha256(), [], 0
    while True:
        try:
            chunk = os.read(fd, CHUNK)
        except OSError as e:
            raise UnsafeFile(f"{what} {_why(e)}") from None
        if not chunk:
            break
        total += len(chunk)
        if total > max_size:  # grew while being read
            raise UnsafeFile(f"{what} is over the bound of {max_size:,} bytes")
        h.update(chunk)
        chunks.append(chunk)
    if sha256 is not None and h.hexdigest() != sha256:
        raise UnsafeFile(f"{what} does not match its sha256 (edited or corrupt)")
    return b"".join(chunks)


def _open_and_read(path, flags: int, *, dir_fd: int | None, max_size: int, what: str,
                   sha256: str | None) -> bytes:
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as e:
        raise UnsafeFile(f"{what} {_why(e)}") from None
    try:
        return _read_fd(fd, max_size=max_size, what=what, sha256=sha256)
    finally:
        os.close(fd)


def read_regular_at(dir_fd: int, name: str, *, max_size: int, what: str,
                    sha256: str | None = None) -> bytes:
    """The bytes of a regular file `name` in directory `dir_fd` (not a link), read in chunks and
    hashed as they come; UnsafeFile (naming `what`) if it is anything else, larger than
    `max_size`, or does not match `sha256`."""
    return _open_and_read(name, _READ_FLAGS, dir_fd=dir_fd, max_size=max_size, what=what, sha256=sha256)


def read_user_file(path: Path, *, max_size: int, what: str) -> bytes:
    """A file the user named on the command line (a link the user made is followed; it must end
    at a regular file of at most `max_size` bytes)."""
    return _open_and_read(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0),
                          dir_fd=None, max_size=max_size, what=what, sha256=None)


def read_regular(root: Path, rel: str, *, max_size: int, what: str, sha256: str | None = None) -> bytes:
    """read_regular_at for `rel` (a relative path with / separators) below the directory `root`:
    `root` itself may be a link the user made; nothing below it may be."""
    parts = rel.split("/")
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UnsafeFile(f"{root} {_why(e)}") from None
    try:
        try:
            dir_fd = open_dir_below(root_fd, parts[:-1])
        except OSError as e:
            raise UnsafeFile(f"{what}: a directory on its path {_why(e)}") from None
        try:
            return read_regular_at(dir_fd, parts[-1], max_size=max_size, what=what, sha256=sha256)
        finally:
            os.close(dir_fd)
    finally:
        os.close(root_fd)


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file beside it, then rename it into place: readers
    see the old file or the whole new one. The temp file has an unpredictable name and is created
    exclusively without following links (O_EXCL | O_NOFOLLOW), so nothing planted beside the
    target (a link at a guessable temp name) can redirect the write (issue 29)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_depth(doc: Any, max_depth: int, what: str) -> None:
    """UnsafeFile if lists / maps nest deeper than `max_depth` (checked without recursion, one
    level at a time: a graph document holds about a million values, and this walk is part of
    every build's and every rank's read of one)."""
    containers = (list, tuple, dict)
    level = [doc] if isinstance(doc, containers) else []
    depth = 1
    while level:
        if depth > max_depth:
            raise UnsafeFile(f"{what} nests deeper than {max_depth} levels")
        children = []
        for value in level:
            children.extend(value.values() if isinstance(value, dict) else value)
        level = [c for c in children if isinstance(c, containers)]
        depth += 1


# What any document may hold whatever its density: a few KiB of lists and strings cannot expand
# into much, and small documents (nesting tests, tiny records) are often dense.
SMALL_DOCUMENT_ALLOWANCE = 1024


def check_json_density(data: bytes, what: str) -> None:
    """UnsafeFile if `data` holds more lists, objects or strings than its size allows (the
    brackets and quotes are counted wherever they are, so this never under-counts)."""
    containers, strings = data.count(b"[") + data.count(b"{"), data.count(b'"') // 2
    if containers > len(data) // JSON_BYTES_PER_CONTAINER + SMALL_DOCUMENT_ALLOWANCE or strings > len(data) // JSON_BYTES_PER_STRING + SMALL_DOCUMENT_ALLOWANCE:
        raise UnsafeFile(f"{what} holds {containers:,} lists or objects and {strings:,} strings in "
                         f"{len(data):,} bytes, more than any document titan writes")


def loads_json(data: bytes, what: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON document, bounded in size before it is parsed (check_json_density) and in
    nesting; UnsafeFile naming `what` otherwise."""
    check_json_density(data, what)
    try:
        doc = json.loads(data)
    except RecursionError:
        raise UnsafeFile(f"{what} nests deeper than {max_depth} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsafeFile(f"{what} is not valid JSON ({e})") from None
    check_depth(doc, max_depth, what)
    return doc


def read_json(path: Path, *, what: str, max_size: int = MAX_JSON_BYTES) -> Any:
    """A JSON file the user named, bounded in size and nesting."""
    return loads_json(read_user_file(path, max_size=max_size, what=what), what)

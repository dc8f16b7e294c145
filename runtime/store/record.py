"""A content-store record on disk, and the per-user names of a store's files. Torch-free.

A record file is one header line, `titan-record-v2 <hmac-sha256 hex>`, then the record's JSON.
The MAC covers the raw JSON bytes (record_signing.py), so a reader bounds the file's size
(fstat, before reading), authenticates its bytes and only then parses them: a planted record
costs a bounded read and one hash, never a parse (issue 29: six planted 60 MiB records made a
cache-miss build take 545 s when records were parsed whole before their MAC was checked).

Each user's records, markers and locks carry the user's uid in their names (`<name>@<uid>`):
in a shared cache two users who build the same key keep one entry each (a record another user
wrote cannot be authenticated with your key anyway), one user's lock never makes another wait,
and maintenance tells a teammate's files (named with their uid, and owned by it) from planted ones.
"""

from __future__ import annotations

import json
import re

from titan.runtime.store.signing import authentic, record_mac
from titan.runtime.common.safe_files import UnsafeFile, loads_json

MAX_RECORD_BYTES = 4 << 20
"""Largest record file read: real ones are under 64 KiB (an entry for 1,024 ranks is ~10 KiB)."""
HEADER = b"titan-record-v2 "
_HEADER_LEN = len(HEADER) + 64 + 1
OWNED_NAME = re.compile(r"([0-9A-Za-z][0-9A-Za-z_.-]{0,127})@([0-9]{1,10})")


def owned_name(name: str, uid: int) -> str:
    """The file name stem of `name` as user `uid` keeps it."""
    return f"{name}@{uid}"


def split_owned_name(stem: str) -> tuple[str, int] | None:
    """(name, uid) of a per-user file name stem, or None for a name titan does not make."""
    m = OWNED_NAME.fullmatch(stem)
    return (m.group(1), int(m.group(2))) if m else None


def encode_record(kind: str, name: str, record: dict) -> bytes:
    body = json.dumps(record, indent=1, sort_keys=True).encode()
    return HEADER + record_mac(kind, name, body).encode() + b"\n" + body


def _split(data: bytes, what: str) -> tuple[str, bytes] | str:
    """(mac, body) of a record file's bytes, or why they are not a record."""
    if not data.startswith(HEADER):
        if data.lstrip().startswith(b"{"):
            return f"{what} is in an older titan's record format (rebuilt on next use)"
        return f"{what} is not a titan record"
    mac = data[len(HEADER):_HEADER_LEN - 1]
    if data[_HEADER_LEN - 1:_HEADER_LEN] != b"\n" or not re.fullmatch(rb"[0-9a-f]{64}", mac):
        return f"{what} is not a titan record"
    return mac.decode(), data[_HEADER_LEN:]


def _parse(body: bytes, what: str) -> dict | str:
    try:
        record = loads_json(body, what)
    except UnsafeFile as e:
        return str(e)
    return record if isinstance(record, dict) else f"{what} is not a titan record"


def decode_record(kind: str, name: str, data: bytes, what: str) -> tuple[dict | None, str]:
    """(record, '') when `data` is a record of `kind`/`name` made with this user's key, else
    (None, why); nothing is parsed before the MAC verifies."""
    split = _split(data, what)
    if isinstance(split, str):
        return None, split
    mac, body = split
    if not authentic(kind, name, body, mac):
        return None, f"{what} is not authenticated (written without your key: tampered, or another user's)"
    parsed = _parse(body, what)
    return (None, parsed) if isinstance(parsed, str) else (parsed, "")


def read_unauthenticated(data: bytes, what: str) -> dict | None:
    """Another user's record, parsed without authentication (their key is not ours): only ever
    used to keep what it names, never to serve it."""
    split = _split(data, what)
    if isinstance(split, str):
        return None
    parsed = _parse(split[1], what)
    return None if isinstance(parsed, str) else parsed

"""The content store behind the build cache and the kernel store (runtime/store/content_store.py,
record_signing.py), in process: blobs are read only when their bytes match their name, records
only when this user's key authenticated them at that name, and nothing planted in the store is
followed. (The stores under real builders, gc and an attacker: e2e/test_cache.py,
e2e/test_trust.py, e2e/test_faults.py.)"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from titan.runtime.store.content_store import ContentStore, StoreError
from titan.runtime.store.signing import KEY_FILE_ENV

DATA = b"graph bytes " * 100


def _store(root) -> ContentStore:
    return ContentStore(root, record_kinds=("entries",))


def test_a_blob_is_read_back_only_while_its_bytes_match_its_name(tmp_path):
    store = _store(tmp_path / "cache")
    sha = store.put_blob(DATA)
    assert sha == hashlib.sha256(DATA).hexdigest() and store.read_blob(sha, max_size=len(DATA)) == DATA
    path = tmp_path / "cache" / "blobs" / sha[:2] / sha
    path.write_bytes(DATA[:-1] + b"!")
    with pytest.raises(StoreError, match=f"^blob {sha[:12]} does not match its sha256 \\(edited or corrupt\\)$"):
        store.read_blob(sha, max_size=len(DATA))
    assert not store.blob_intact(sha, max_size=len(DATA))
    assert store.put_blob(DATA) == sha and store.read_blob(sha, max_size=len(DATA)) == DATA, "a damaged copy is replaced"
    with pytest.raises(StoreError, match=f"^blob {sha[:12]} is {len(DATA):,} bytes, over the bound of 10$"):
        store.read_blob(sha, max_size=10)
    with pytest.raises(StoreError, match="^blob '../../etc/passwd' is not a sha256 digest$"):
        store.read_blob("../../etc/passwd", max_size=10)
    with pytest.raises(StoreError, match=f"^blob {'0' * 12} is missing$"):
        store.read_blob("0" * 64, max_size=10)


def _not_authenticated(name: str) -> tuple:
    return None, f"entries/{name} is not authenticated (written without your key: tampered, or another user's)"


def test_a_record_is_served_only_as_this_user_signed_it_at_its_name(tmp_path, monkeypatch):
    store = _store(tmp_path / "cache")
    record = {"forward": "a" * 64, "ranks": [0, 1]}
    store.put_record("entries", "k1", record)
    assert store.record_state("entries", "k1") == (record, "") and store.record_names("entries") == ["k1"]
    path = tmp_path / "cache" / "entries" / f"k1@{os.getuid()}.json"
    signed = path.read_bytes()
    # Edited by someone without the key: refused.
    path.write_bytes(signed.replace(b"a" * 64, b"b" * 64))
    assert store.record_state("entries", "k1") == _not_authenticated("k1")
    # A genuine record copied to another name: refused (the name is signed too).
    (tmp_path / "cache" / "entries" / f"k2@{os.getuid()}.json").write_bytes(signed)
    assert store.record_state("entries", "k2") == _not_authenticated("k2")
    # Signed with another user's key: refused.
    path.write_bytes(signed)
    assert store.get_record("entries", "k1") == record
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "other.key"))
    assert store.record_state("entries", "k1") == _not_authenticated("k1")
    assert store.record_state("entries", "nope") == (None, "missing")


def test_a_planted_link_is_refused_and_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = _store(tmp_path / "cache")
    sha = store.put_blob(DATA)
    prefix = tmp_path / "cache" / "blobs" / sha[:2]
    (prefix / sha).unlink()
    prefix.rmdir()
    prefix.symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreError, match=f"^{prefix} is a symbolic link, which titan never makes \\(planted\\?\\)"):
        store.put_blob(DATA)
    assert list(outside.iterdir()) == [], "nothing was written through the link"
    (tmp_path / "cache" / "entries").rename(tmp_path / "moved")
    (tmp_path / "cache" / "entries").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreError, match="entries is a symbolic link, which titan never makes"):
        _store(tmp_path / "cache")


def test_a_store_others_may_write_needs_the_shared_opt_in(tmp_path, monkeypatch):
    _store(tmp_path / "cache")
    os.chmod(tmp_path / "cache" / "entries", 0o777)
    with pytest.raises(StoreError, match="entries is writable by group or others; run chmod go-w"):
        _store(tmp_path / "cache")
    monkeypatch.setenv("TITAN_SHARED_CACHE", "1")
    assert _store(tmp_path / "cache").record_names("entries") == []

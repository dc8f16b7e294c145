"""The trust model (docs/trust.md) against an attacker who can write the shared cache: every
plant is refused or ignored (rebuilt, recompiled), no canary file is created, nothing outside
the cache is touched, and `titan-cache verify` reports the tampering."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time

import msgpack
import pytest

from conftest import cache_record, own, titan

SINGLE = ("--flavor", "debug")
CACHE_DIRS = ("blobs", "ranks", "entries", "used", "locks", "tmp", "kernels")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache holding one debug build, and the artifact exported from it."""
    root = tmp_path_factory.mktemp("trust")
    r = titan("build", *SINGLE, "--out", root / "art", env=dict(os.environ, TITAN_CACHE_DIR=str(root / "cache")))
    assert r.returncode == 0, r.stderr
    return root


@pytest.fixture
def victim(built, tmp_path):
    """A private copy of the built cache, an outside directory with a sentinel file, and the env."""
    cache = tmp_path / "cache"
    shutil.copytree(built / "cache", cache, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    key = json.loads((built / "art" / "manifest.json").read_text())["cache_key"]
    return cache, outside, key, dict(os.environ, TITAN_CACHE_DIR=str(cache))


def _outside_untouched(outside) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["sentinel"]
    assert (outside / "sentinel").read_text() == "keep me"


def _one_error_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def _put_blob(cache, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    (cache / "blobs" / sha[:2]).mkdir(exist_ok=True)
    (cache / "blobs" / sha[:2] / sha).write_bytes(data)
    return sha


def _rewrite_record(path, change) -> None:
    """Edit a record as an attacker without the user's key must: the MAC no longer matches (a
    MAC made with another key is the same to the victim)."""
    record = cache_record(path)
    change(record)
    body = json.dumps(record).encode()
    path.write_bytes(b"titan-record-v2 " + hashlib.sha256(b"attacker" + body).hexdigest().encode() + b"\n" + body)


@pytest.mark.parametrize("how", ["new graph blob", "region tag added"])
def test_rewritten_rank_record_is_not_served(victim, tmp_path, how):
    cache, outside, key, env = victim
    (rank_path,) = (cache / "ranks").glob("*.json")
    record = cache_record(rank_path)
    original = record["forward"]
    doc = msgpack.unpackb((cache / "blobs" / original[:2] / original).read_bytes(), raw=False)
    if how == "new graph blob":
        doc["nodes"][-2]["name"] = "attacker_graph"
    else:  # a user who never asked for fusion must not get kernels through a tag
        doc["nodes"][-2]["region"] = "block#0"
    planted = _put_blob(cache, msgpack.packb(doc, use_bin_type=True))
    _rewrite_record(rank_path, lambda rec: rec.update(forward=planted))

    v = titan("cache", "verify", env=env)
    assert v.returncode == 1 and "not authenticated" in v.stdout, v.stdout
    r = titan("build", *SINGLE, "--out", tmp_path / "art", env=env)
    assert r.returncode == 0, r.stderr
    # The authenticated entry names its programs' blobs itself: the tampered record of the
    # traced rank is not consulted, and what is served is what the entry recorded.
    assert "cache: hit" in r.stdout and "traced in" not in r.stdout
    files = json.loads((tmp_path / "art" / "manifest.json").read_text())["files"]
    assert f"graphs/{original}.tgraph" in files and f"graphs/{planted}.tgraph" not in files
    _outside_untouched(outside)


def test_region_tag_in_an_artifact_built_without_that_fusion_is_refused(built, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(built / "art", art)
    m = json.loads((art / "manifest.json").read_text())
    rel = m["programs"][0]["forward"]
    doc = msgpack.unpackb((art / rel).read_bytes(), raw=False)
    doc["nodes"][-2]["region"] = "block#0"
    (art / rel).write_bytes(msgpack.packb(doc, use_bin_type=True))
    m["files"][rel] = hashlib.sha256((art / rel).read_bytes()).hexdigest()  # hash-consistent, as crafted
    (art / "manifest.json").write_text(json.dumps(m))
    line = _one_error_line(titan("run", art, "--steps", 1))
    assert "region" in line


class _Canary:
    """Unpickling this creates the canary file: the code execution a planted kernel would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_planted_kernel_with_consistent_digest_is_never_loaded(victim):
    from titan.runtime.store.kernel_store import KernelStore

    cache, outside, _, env = victim
    canary = outside / "canary"
    payload = pickle.dumps(_Canary(canary))
    kernels = cache / "kernels"
    store = KernelStore(kernels)  # makes the store as titan-run would
    key = "0" * 32
    sha = _put_blob(kernels, payload)
    # The old store's format (a .sha256 sidecar) and the new one's (a record), both consistent
    # with the planted bytes, neither authenticated with the victim's key.
    (kernels / f"{key}.bin").write_bytes(payload)
    (kernels / f"{key}.sha256").write_text(sha + "\n")
    (kernels / "kernels" / f"{own(key)}.json").write_text("titan-record-v2 " + "0" * 64 + "\n" + json.dumps(
        {"key": key, "sha256": sha, "size": len(payload), "device": "NVIDIA H100 sm90"}))
    assert store.load(key) is None
    v = titan("cache", "verify", env=env)
    assert v.returncode == 1 and "kernel" in v.stdout and "not authenticated" in v.stdout, v.stdout
    assert not canary.exists()
    r = titan("cache", "verify", "--remove", env=env)
    assert r.returncode == 1 and not (kernels / "kernels" / f"{own(key)}.json").exists()
    assert titan("cache", "verify", env=env).returncode == 0
    _outside_untouched(outside)


@pytest.mark.parametrize("sub", CACHE_DIRS)
def test_symlinked_cache_directory_is_refused_and_nothing_outside_is_touched(victim, tmp_path, sub):
    cache, outside, _, env = victim
    target = cache / sub
    if target.exists():
        shutil.rmtree(target)
    target.symlink_to(outside, target_is_directory=True)
    for args in (("build", *SINGLE, "--out", tmp_path / "art"), ("cache", "gc", "--max-size", "0"),
                 ("cache", "ls"), ("cache", "verify", "--remove")):
        r = titan(*args, env=env)
        if args[:2] == ("cache", "verify"):
            assert r.returncode == 1 and "tampered" in r.stdout and "symbolic link" in r.stdout, r.stdout
        else:
            assert "symbolic link" in _one_error_line(r)
        _outside_untouched(outside)
    assert not target.is_symlink(), "verify --remove unlinked the planted link (and only it)"
    assert titan("build", *SINGLE, "--out", tmp_path / "art", env=env).returncode == 0
    _outside_untouched(outside)


def test_symlinked_blob_prefix_lock_and_marker_create_nothing_outside(victim, tmp_path):
    cache, outside, key, env = victim
    canary = outside / "canary"
    (cache / "locks" / f"{own(key)}.lock").unlink(missing_ok=True)
    (cache / "locks" / f"{own(key)}.lock").symlink_to(canary)
    (cache / "used" / own(key)).unlink(missing_ok=True)
    (cache / "used" / own(key)).symlink_to(outside / "canary2")
    (cache / "tmp" / "planted").symlink_to(outside / "sentinel")
    prefix = next((cache / "blobs").iterdir())
    shutil.rmtree(prefix)
    prefix.symlink_to(outside, target_is_directory=True)

    v = titan("cache", "verify", env=env)
    assert v.returncode == 1 and v.stdout.count("planted?") >= 3, v.stdout
    r = titan("build", *SINGLE, "--out", tmp_path / "art", env=env)
    assert "symbolic link" in _one_error_line(r)
    gc = titan("cache", "gc", "--older-than", "0s", env=env)
    assert gc.returncode == 0, gc.stderr
    assert titan("cache", "verify", "--remove", env=env).returncode == 1
    r = titan("build", *SINGLE, "--out", tmp_path / "art", env=env)
    assert r.returncode == 0, r.stderr
    assert not canary.exists() and not (outside / "canary2").exists()
    _outside_untouched(outside)
    assert titan("cache", "verify", env=env).returncode == 0


def test_cache_writable_by_others_needs_an_explicit_opt_in(victim, tmp_path):
    cache, outside, _, env = victim
    os.chmod(cache / "entries", 0o777)
    line = _one_error_line(titan("build", *SINGLE, "--out", tmp_path / "art", env=env))
    assert "writable by group or others" in line and "TITAN_SHARED_CACHE=1" in line
    r = titan("build", *SINGLE, "--out", tmp_path / "art", env=dict(env, TITAN_SHARED_CACHE="1"))
    assert r.returncode == 0 and "cache: hit" in r.stdout, r.stderr


def test_records_signed_with_another_users_key_are_ignored(victim, tmp_path):
    cache, outside, _, env = victim
    other = dict(env, TITAN_KEY_FILE=str(tmp_path / "other.key"))
    r = titan("build", *SINGLE, "--out", tmp_path / "art", env=other)
    assert r.returncode == 0 and "cache: miss" in r.stdout and "not authenticated" in r.stdout, r.stdout
    key = tmp_path / "other.key"
    os.chmod(key, 0o644)
    assert "chmod 600" in _one_error_line(titan("build", *SINGLE, "--out", tmp_path / "art", env=other))


@pytest.mark.parametrize("size", [3 << 20, 60 << 20])
def test_planted_large_records_cost_a_bounded_read_never_a_parse(victim, tmp_path, size):
    """Six planted records of JSON that is slow to parse (issue 29: 545 s for a cache-miss build
    when records were parsed before their MAC): under the record bound they are authenticated on
    their bytes and ignored unparsed; over it they are refused by size before being read."""
    cache, outside, key, env = victim
    body = b"[" + b"[]," * (size // 3 - 1) + b"[]]"
    header = b"titan-record-v2 " + b"0" * 64 + b"\n"
    for i in range(6):
        (cache / "entries" / f"{own(f'{i:032x}')}.json").write_bytes(header + body)
        (cache / "ranks" / f"{own(f'{i + 6:032x}')}.json").write_bytes(header + body)
    for args in (("cache", "ls"), ("build", *SINGLE, "--seq-len", 64, "--out", tmp_path / "art")):
        t0 = time.monotonic()
        r = titan(*args, env=env)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - t0 < 60, f"{args[0]} took {time.monotonic() - t0:.0f} s"
    v = titan("cache", "verify", env=env)
    assert v.returncode == 1 and v.stdout.count("tampered") >= 12, v.stdout
    expected = "over the bound" if size > (4 << 20) else "not authenticated"
    assert v.stdout.count(expected) == 12, v.stdout

"""The shared build cache: hits trace nothing, concurrent builders trace once, killed builders
leave nothing that is trusted, corruption is caught, misses are explained, gc is safe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import filelock

import pytest

from conftest import own, read_metrics, titan
from titan.runtime.contract.artifact import open_artifact

SINGLE = ("--flavor", "debug")


def _env(cache) -> dict:
    return dict(os.environ, TITAN_CACHE_DIR=str(cache))


def _files(art) -> dict:
    return open_artifact(art).manifest.files


def test_second_build_is_a_hit_and_traces_nothing(tmp_path):
    cache = tmp_path / "cache"
    first = titan("build", *SINGLE, "--tp", 2, "--out", tmp_path / "a", env=_env(cache))
    assert first.returncode == 0, first.stderr
    assert "cache: miss" in first.stdout and first.stdout.count("traced in") == 2
    second = titan("build", *SINGLE, "--tp", 2, "--out", tmp_path / "b", env=_env(cache))
    assert second.returncode == 0, second.stderr
    assert "cache: hit" in second.stdout and "traced in" not in second.stdout
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    # tp ranks share one program (their vocab offsets are bound at load): traced ranks 0 and 1.
    ls = titan("cache", "ls", env=_env(cache))
    assert ls.returncode == 0 and ls.stdout.count("llama3 debug") == 1


def test_ranks_with_identical_graphs_share_blobs(tmp_path):
    r = titan("build", *SINGLE, "--dp-shard", 2, "--out", tmp_path / "a", env=_env(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    manifest = open_artifact(tmp_path / "a").manifest
    assert manifest.rank_programs == (0, 0) and len(manifest.programs) == 1
    assert sum(rel.startswith("graphs/") for rel in manifest.files) == 2


def test_concurrent_builders_of_one_key_trace_once(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-m", "titan.cli.build", *SINGLE, "--out", str(tmp_path / f"a{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(cache))
             for i in range(8)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert sum("traced in" in o for o, _ in outs) == 1
    assert sum("cache: hit" in o for o, _ in outs) == 7
    assert len(list((cache / "entries").glob("*.json"))) == 1
    first = _files(tmp_path / "a0")
    for i in range(1, 8):
        assert _files(tmp_path / f"a{i}") == first
        for rel in first:
            assert (tmp_path / f"a{i}" / rel).read_bytes() == (tmp_path / "a0" / rel).read_bytes()


@pytest.mark.slow
def test_killed_builder_leaves_nothing_trusted_and_rebuild_runs_as_before(tmp_path):
    ref_cache, cache = tmp_path / "ref-cache", tmp_path / "cache"
    assert titan("build", *SINGLE, "--tp", 2, "--out", tmp_path / "ref", env=_env(ref_cache)).returncode == 0
    # Kill one builder as soon as its first rank is committed (mid-write of the build), and
    # one during tracing.
    for trigger in ("rank-record", "early"):
        p = subprocess.Popen([sys.executable, "-m", "titan.cli.build", *SINGLE, "--tp", "2", "--jobs", "1",
                              "--out", str(tmp_path / "killed")], env=_env(cache),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if trigger == "early" and time.monotonic() > deadline - 297:
                break
            if trigger == "rank-record" and list((cache / "ranks").glob("*.json")):
                break
            time.sleep(0.01)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        assert not list((cache / "entries").glob("*.json")), "a killed build must not leave an entry"
        assert not (tmp_path / "killed").exists()
    rebuilt = titan("build", *SINGLE, "--tp", 2, "--out", tmp_path / "rebuilt", env=_env(cache))
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert rebuilt.stdout.count("traced in") == 1, "the rank committed before the kill is reused"
    assert _files(tmp_path / "rebuilt") == _files(tmp_path / "ref")
    losses = []
    for art in ("ref", "rebuilt"):
        m = tmp_path / f"{art}.jsonl"
        assert titan("run", tmp_path / art, "--steps", 3, "--metrics", m).returncode == 0
        losses.append([rec["loss"] for rec in read_metrics(m)])
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_flipped_byte_is_caught_by_verify_rebuild_and_runtime(tmp_path):
    cache = tmp_path / "cache"
    assert titan("build", *SINGLE, "--out", tmp_path / "a", env=_env(cache)).returncode == 0
    blob = sorted((cache / "blobs").glob("*/*"), key=lambda p: -p.stat().st_size)[0]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    v = titan("cache", "verify", env=_env(cache))
    assert v.returncode == 1 and f"corrupt: {blob.name}" in v.stdout
    r = titan("build", *SINGLE, "--out", tmp_path / "b", env=_env(cache))
    assert r.returncode == 0, r.stderr
    assert "cache: miss" in r.stdout and "corrupt" in r.stdout and "traced in" in r.stdout
    assert titan("cache", "verify", env=_env(cache)).returncode == 0, "the rebuild rewrote the blob"
    graph = tmp_path / "b" / sorted(rel for rel in _files(tmp_path / "b") if rel.startswith("graphs/"))[0]
    data = bytearray(graph.read_bytes())
    data[-1] ^= 0x80
    graph.write_bytes(bytes(data))
    run = titan("run", tmp_path / "b", "--steps", 1)
    assert run.returncode == 2 and "does not match its sha256" in run.stderr


@pytest.mark.slow
def test_explain_names_the_changed_factor(tmp_path):
    cache = tmp_path / "cache"
    assert titan("build", *SINGLE, "--out", tmp_path / "a", env=_env(cache)).returncode == 0
    r = titan("build", *SINGLE, "--seq-len", 64, "--partitioner", "default", "--explain", "--out", tmp_path / "b",
              env=_env(cache))
    assert r.returncode == 0, r.stderr
    miss = next(line for line in r.stdout.splitlines() if line.startswith("cache: miss"))
    assert "seq len 128 -> 64" in miss and "passes +partition:default -partition:min_cut" in miss


@pytest.mark.slow
def test_gc_by_age_and_size_skips_locked_entries(tmp_path):
    cache = tmp_path / "cache"
    for seq in (64, 128):
        assert titan("build", *SINGLE, "--seq-len", seq, "--out", tmp_path / f"s{seq}", env=_env(cache)).returncode == 0
    keys = {open_artifact(tmp_path / f"s{seq}").manifest.cache_key: seq for seq in (64, 128)}
    old_key = next(k for k, s in keys.items() if s == 64)
    new_key = next(k for k, s in keys.items() if s == 128)
    # Age the whole cache by two days, then use the seq-128 entry now.
    two_days_ago = time.time() - 2 * 86400
    for path in cache.rglob("*"):
        if path.is_file():
            os.utime(path, (two_days_ago, two_days_ago))
    os.utime(cache / "used" / own(new_key))

    r = titan("cache", "gc", "--older-than", "3d", env=_env(cache))
    assert r.returncode == 0 and "removed" not in r.stdout
    r = titan("cache", "gc", "--older-than", "1d", env=_env(cache))
    assert f"removed {old_key[:12]}" in r.stdout and new_key[:12] not in r.stdout
    assert not (cache / "entries" / f"{own(old_key)}.json").exists()

    lock = filelock.FileLock(str(cache / "locks" / f"{own(new_key)}.lock"))
    with lock:
        r = titan("cache", "gc", "--max-size", "0", env=_env(cache))
        assert f"kept {new_key[:12]} (a build holds it)" in r.stdout
    assert (cache / "entries" / f"{own(new_key)}.json").exists()
    r = titan("cache", "gc", "--max-size", "0", env=_env(cache))
    assert f"removed {new_key[:12]}" in r.stdout
    assert titan("cache", "ls", env=_env(cache)).stdout.strip().endswith("empty")
    assert not list((cache / "blobs").glob("*/*")), "blobs of removed entries are freed"

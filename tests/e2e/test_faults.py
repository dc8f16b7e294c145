"""Faults end cleanly: a dead rank stops the job in bounded time and is named, a
full disk or unusable cache fails the build with one line and leaves the cache consistent,
and the cache survives many concurrent builders with gc running alongside."""

from __future__ import annotations

import pytest

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import titan
from processes import children, process_stats, torchrun_envs

SINGLE = ("--flavor", "debug")


def _wait_for(stream_path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stream_path.exists() and text in stream_path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {stream_path}: {stream_path.read_text()[-2000:]}")


@pytest.mark.slow
def test_killed_rank_makes_its_peer_exit_with_a_clear_error(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    procs, logs = [], []
    for rank, env in enumerate(torchrun_envs(2, PYTHONUNBUFFERED="1")):
        out, err = tmp_path / f"out{rank}", tmp_path / f"err{rank}"
        logs.append((out, err))
        procs.append(subprocess.Popen([sys.executable, "-m", "titan.cli.run", str(art), "--steps", "100000",
                                       "--timeout", "30"], env=env, stdout=open(out, "w"), stderr=open(err, "w")))
    try:
        _wait_for(logs[0][0], "step    3/", 120)
        procs[1].kill()
        t0 = time.monotonic()
        code = procs[0].wait(timeout=90)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert code == 1
    assert waited < 60
    err = logs[0][1].read_text()
    assert "error: rank 0: a collective failed because rank 1 died" in err
    assert "Traceback" not in err


def test_titan_run_fails_when_one_of_its_ranks_is_killed(debug_artifact, tmp_path):
    art = debug_artifact(dp_shard=2)
    out = tmp_path / "out"
    err = tmp_path / "err"
    launcher = subprocess.Popen([sys.executable, "-m", "titan.cli.run", str(art), "--steps", "100000"],
                                stdout=open(out, "w"), stderr=open(err, "w"), env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_for(out, "step    3/", 120)
        ranks = children(launcher.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        code = launcher.wait(timeout=60)
    finally:
        launcher.kill()
    assert code == 1
    assert "error: rank 1 was killed by SIGKILL" in err.read_text()
    assert "Traceback" not in err.read_text()
    time.sleep(0.5)
    assert not {pid for pid, fields in process_stats() if fields[0] != "Z"} & set(ranks)


def _limit_file_size():
    # Writes past 16 KiB fail as on a full disk (EFBIG; Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))


@pytest.mark.slow
def test_full_disk_during_build_fails_cleanly_and_leaves_the_cache_consistent(tmp_path):
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "titan.cli.build", *SINGLE, "--out", str(tmp_path / "art")],
                       env=env, capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot write to ") and "free space there" in line and "--cache-dir" in line
    assert not list((tmp_path / "cache" / "entries").glob("*.json"))
    assert not list((tmp_path / "cache" / "tmp").iterdir()), "no partial files left behind"
    assert titan("cache", "verify", env=env).returncode == 0
    assert titan("build", *SINGLE, "--out", tmp_path / "art", env=env).returncode == 0


def test_unusable_cache_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = titan("build", *SINGLE, "--cache-dir", blocker / "cache", "--out", tmp_path / "art")
    assert r.returncode == 2
    assert "cannot use cache directory" in r.stderr and "--cache-dir" in r.stderr


@pytest.mark.slow
def test_cache_load_32_builders_4_keys_with_gc_alongside(tmp_path):
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    seqs = (32, 64, 96, 128)
    t0 = time.monotonic()
    builders = [subprocess.Popen([sys.executable, "-m", "titan.cli.build", *SINGLE, "--seq-len", str(seqs[i % 4]),
                                  "--jobs", "1", "--out", str(tmp_path / f"a{i}")], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(32)]
    gc_runs, removed, kept_locked = 0, 0, 0
    while any(b.poll() is None for b in builders):
        # Room for about one entry: gc keeps evicting while builders keep committing.
        r = titan("cache", "gc", "--max-size", "100K", env=env)
        assert r.returncode == 0, r.stderr
        gc_runs += 1
        removed += r.stdout.count("removed ")
        kept_locked += r.stdout.count("(a build holds it)")
    results = [b.communicate() for b in builders]
    elapsed = time.monotonic() - t0
    assert all(b.returncode == 0 for b in builders), [e for _, e in results if e]
    traced = sum("traced in" in out for out, _ in results)
    print(f"load test: 32 builds over 4 keys in {elapsed:.1f} s, {traced} traced, {gc_runs} gc runs alongside "
          f"({removed} entries removed, {kept_locked} kept because a build held them)")
    assert gc_runs >= 1 and removed >= 1 and 4 <= traced <= 32
    # Every artifact is complete and every remaining cache entry verifies.
    for i in range(32):
        r = subprocess.run([sys.executable, "-c", "import sys; from titan.runtime.contract.artifact import open_artifact;"
                            "open_artifact(sys.argv[1]).verify_all()", str(tmp_path / f"a{i}")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert titan("cache", "verify", env=env).returncode == 0
    from titan.runtime.store.build_cache import Cache
    cache = Cache(tmp_path / "cache")
    assert all(cache.get_entry(k)[0] is not None for k in cache.entry_keys())

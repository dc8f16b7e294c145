"""Ctrl-C is correct at every instant: a SIGINT to the whole process group (as a terminal sends
it) at 30+ instants of a build and of a run, with two CPU-bound processes beside them, always
ends in status 130 with exactly one `interrupted` line and nothing else on stderr (no traceback,
no warning from a worker or a rank), no process left, no artifact or cache entry left, and a
cache that verifies.

The instants run concurrently in small batches (each build has its own cache, so each is a
cold build), which keeps the wall time near the 15 s span itself; the load makes the phases
slower, so the instants fall into every phase: start-up imports, the workers' start, tracing.
Instants on the cache-hit path (export and rename into place) use the session's warm cache, and
instants of a run fall into its start-up and, counted from its first step, into its steps."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import titan
from processes import default_sigint, session_pids

BUILD = ("--flavor", "debug", "--tp", "2", "--jobs", "2")
BATCH = 8


@contextlib.contextmanager
def _load(n: int = 2):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


def _interrupt_at(commands: list[tuple[list[str], dict, float]], tmp_path: Path,
                  ready: Path | None = None) -> list[dict]:
    """Start each command (argv, env, delay) and SIGINT its process group `delay` seconds after
    its start (or after its `ready` file has a line: argv may hold {i}); wait for all."""
    started = []
    for i, (argv, env, delay) in enumerate(commands):
        n = len(list(tmp_path.glob('err-*')))
        err, out = tmp_path / f"err-{n}", tmp_path / f"out-{n}"
        p = subprocess.Popen(argv, env=env, stdout=open(out, "w"), stderr=open(err, "w"),
                             start_new_session=True, preexec_fn=default_sigint)
        started.append({"p": p, "err": err, "out": out, "delay": delay, "t0": time.monotonic(), "argv": argv, "sent": False})
    if ready is not None:  # the delay counts from the first line in each run's file
        for run in started:
            path = Path(str(ready).format(i=started.index(run)))
            deadline = time.monotonic() + 120
            while run["p"].poll() is None and time.monotonic() < deadline and not (
                    path.exists() and path.read_text().endswith("\n")):
                time.sleep(0.02)
            run["t0"] = time.monotonic()
            time.sleep(run["delay"])
            if run["p"].poll() is None:
                os.killpg(run["p"].pid, signal.SIGINT)
                run["sent"] = True
    for run in sorted(started, key=lambda r: r["delay"]):
        time.sleep(max(0.0, run["t0"] + run["delay"] - time.monotonic()))
        if not run["sent"] and run["p"].poll() is None:
            os.killpg(run["p"].pid, signal.SIGINT)
            run["sent"] = True
    for run in started:
        try:
            run["code"] = run["p"].wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run["p"].pid, signal.SIGKILL)
        time.sleep(0.2)
        run["left"] = session_pids(run["p"].pid)
        run["stderr"] = run["err"].read_text()
        run["stdout"] = run["out"].read_text()
    return started


def _check_interrupted(run: dict) -> bool:
    """True for an instant that interrupted the command, False for one after it had finished."""
    where = f"SIGINT at {run['delay']:.2f} s: {' '.join(run['argv'][2:])}"
    assert not run["left"], f"{where}: processes left behind: {run['left']}"
    if not run["sent"] or run["code"] == 0:
        # It finished first (a loaded machine sends late), or the signal came after its last
        # bytecode: then its work is all done.
        assert run["code"] == 0, f"{where}: exit {run['code']}: {run['stderr'][-3000:]}"
        assert run["stdout"].splitlines()[-1].startswith("wrote "), f"{where}: a lost interrupt: {run['stdout']}"
        return False
    if run["code"] == -signal.SIGINT:
        # Before the interpreter ran any of titan's code, SIGINT's default action ends it: the
        # shell shows status 130 and nothing is printed or written.
        assert run["stderr"] == "", f"{where}: {run['stderr'][-3000:]}"
        return True
    assert run["code"] == 130, f"{where}: exit {run['code']}: {run['stderr'][-3000:]}"
    assert run["stderr"] == "interrupted\n", f"{where}: {run['stderr'][-3000:]}"
    return True


def _check_all(runs: list[dict], *, at_least: int) -> None:
    failures, interrupted = [], 0
    for run in runs:
        try:
            interrupted += _check_interrupted(run)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0][:600])
    assert not failures, f"{len(failures)} of {len(runs)} instants failed:\n" + "\n".join(failures)
    assert interrupted >= at_least, f"only {interrupted} instants came before the command finished"


def test_ctrl_c_at_any_instant_of_a_build(debug_artifact, tmp_path):
    delays = [0.0, 0.02, 0.05, 0.1, 0.2, 0.3] + [0.5 * i for i in range(1, 31)]  # 36 instants, 0..15 s
    hit_delays = [0.05 * i for i in range(1, 9)] + [0.5, 0.7, 1.0]  # the cache-hit path: export, rename
    debug_artifact(tp=2)  # the session's cache holds this build: the instants after tracing use it
    warm_env = dict(os.environ, PYTHONUNBUFFERED="1")
    runs = []
    with _load():
        commands = []
        for i, d in enumerate(delays):
            env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / f"cache{i}"), PYTHONUNBUFFERED="1")
            commands.append(([sys.executable, "-m", "titan.cli.build", *BUILD, "--out", str(tmp_path / f"art{i}")],
                             env, d))
        for i, d in enumerate(hit_delays):
            commands.append(([sys.executable, "-m", "titan.cli.build", *BUILD, "--out", str(tmp_path / f"hit{i}")],
                             warm_env, d))
        # Interleave long and short delays so that each batch spans the whole 0..15 s.
        commands.sort(key=lambda c: c[2])
        batches = [commands[i::len(commands) // BATCH + 1] for i in range(len(commands) // BATCH + 1)]
        for batch in batches:
            runs += _interrupt_at(batch, tmp_path)
    _check_all(runs, at_least=30)
    for i in range(len(delays)):
        cache, art = tmp_path / f"cache{i}", tmp_path / f"art{i}"
        assert not art.exists(), art
        assert not list((cache / "entries").glob("*.json")) if cache.exists() else True
        if cache.exists():
            assert titan("cache", "verify", env=dict(os.environ, TITAN_CACHE_DIR=str(cache))).returncode == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left"
    assert titan("cache", "verify", env=warm_env).returncode == 0


def test_ctrl_c_at_any_instant_of_a_run(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def run(name: str) -> list[str]:
        return [sys.executable, "-m", "titan.cli.run", str(art), "--steps", "100000", "--metrics",
                str(tmp_path / name)]
    start_up = [0.0, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0]
    in_steps = [0.0, 0.05, 0.15, 0.3, 0.6, 1.0]  # after the first step's metrics line
    runs = []
    with _load():
        for batch in (start_up[0::2], start_up[1::2]):
            runs += _interrupt_at([(run(f"start{d}.jsonl"), env, d) for d in batch], tmp_path)
        stepping = _interrupt_at([(run(f"steps{i}.jsonl"), env, d) for i, d in enumerate(in_steps)], tmp_path,
                                 ready=tmp_path / "steps{i}.jsonl")
    _check_all(runs + stepping, at_least=len(start_up) + len(in_steps))
    for i in range(len(in_steps)):
        lines = (tmp_path / f"steps{i}.jsonl").read_text()
        assert lines.endswith("\n") and lines.count("\n") >= 1, "a cut metrics line"

"""Ctrl-C, SIGTERM and SIGKILL leave nothing behind at any instant of a command.

A SIGINT to the whole process group (as a terminal sends it) at 30+ instants of a build and of a
run, with two CPU-bound processes beside them, always ends in status 130 with exactly one
`interrupted` line and nothing else on stderr (no traceback, no warning from a worker or a
rank), no process left, no artifact or cache entry left, and a cache that verifies.

The instants run concurrently in small batches (each build has its own cache, so each is a
cold build), which keeps the wall time near the 15 s span itself; the load makes the phases
slower, so the instants fall into every phase: start-up imports, the workers' start, tracing.
Instants on the cache-hit path (export and rename into place) use the session's warm cache, and
instants of a run fall into its start-up and, counted from its first step, into its steps.

Then each way a command is stopped (SIGINT to the group, SIGINT or SIGTERM to the command
alone, SIGKILL of the command) in each phase named by what the command printed or wrote last:
a build's fork server starting, tracing, writing; a run's ranks starting, stepping, writing a
checkpoint. A process left behind is looked for in the command's session and by a mark in the
environment of everything it started (tests/processes.py), never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from conftest import titan
from processes import default_sigint, kill_all, left_behind, marked_env

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
        env = marked_env(env)
        p = subprocess.Popen(argv, env=env, stdout=open(out, "w"), stderr=open(err, "w"),
                             start_new_session=True, preexec_fn=default_sigint)
        started.append({"p": p, "err": err, "out": out, "delay": delay, "t0": time.monotonic(), "argv": argv,
                        "sent": False, "env": env})
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
        _finish(run)
    return started


# How long the processes a command started may outlive it: a killed command's children notice at
# once (runtime/common/parent_death.py), but their exit takes a moment on a loaded machine.
LEFT_WITHIN_S = 10.0


def _finish(run: dict) -> None:
    """Wait for a command, note what it left running (then end that) and what it printed."""
    try:
        run["code"] = run["p"].wait(timeout=60)
    except subprocess.TimeoutExpired:
        run["code"] = "still running 60 s after the signal"
    finally:
        run["left"] = left_behind(run["p"].pid, run["env"], within_s=LEFT_WITHIN_S)
        kill_all(run["p"].pid, run["env"])
        with contextlib.suppress(subprocess.TimeoutExpired):
            run["p"].wait(timeout=10)
    run["stderr"] = run["err"].read_text()
    run["stdout"] = run["out"].read_text()


def _before_titan_code(run: dict) -> bool:
    """A SIGINT during the interpreter's own start, after it installed its handler but while
    `site` still runs the environment's `.pth` files (one that imports a package takes tens of
    milliseconds on a loaded machine): a KeyboardInterrupt whose traceback holds no frame of
    titan's, nothing on stdout, and no artifact; titan has not run yet, so it has nothing to clean."""
    err = run["stderr"]
    titan_frames = [line for line in err.splitlines() if line.strip().startswith("File ")
                    and any(f"/{top}/" in line for top in ("builder", "runtime", "cli"))
                    and "__editable__" not in line]
    return (run["code"] == 1 and err.rstrip().endswith("KeyboardInterrupt") and "<frozen site>" in err
            and not titan_frames and run["stdout"] == "")


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
    if _before_titan_code(run):
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


@pytest.mark.slow
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
    # A build that finished before its signal (status 0, checked above to have written its
    # artifact) leaves a whole build; every interrupted one leaves no artifact and no entry.
    finished = {run["argv"][-1] for run in runs if run["code"] == 0}
    for i in range(len(delays)):
        cache, art = tmp_path / f"cache{i}", tmp_path / f"art{i}"
        if str(art) in finished:
            continue
        assert not art.exists(), art
        assert not list((cache / "entries").glob("*.json")) if cache.exists() else True
        if cache.exists():
            assert titan("cache", "verify", env=dict(os.environ, TITAN_CACHE_DIR=str(cache))).returncode == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left"
    assert titan("cache", "verify", env=warm_env).returncode == 0


@pytest.mark.slow
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


# Each way a command is stopped: how it is sent, and the status and stderr it must end with.
STOPS = {
    "ctrl-c": (lambda pid: os.killpg(pid, signal.SIGINT), 130, "interrupted\n"),
    "sigint": (lambda pid: os.kill(pid, signal.SIGINT), 130, "interrupted\n"),
    "sigterm": (lambda pid: os.kill(pid, signal.SIGTERM), 143, "terminated\n"),
    "sigkill": (lambda pid: os.kill(pid, signal.SIGKILL), -signal.SIGKILL, ""),
}
# A phase: (argv, env, `ready(run)` once the command is in it, seconds more before the signal).
Phase = tuple[list[str], dict, Callable[[dict], bool], float]


def _printed(text: str) -> Callable[[dict], bool]:
    return lambda run: text in run["out"].read_text()


def _has_line(path: Path) -> Callable[[dict], bool]:
    return lambda run: path.exists() and "\n" in path.read_text()


def _exists(folder: Path, pattern: str) -> Callable[[dict], bool]:
    return lambda run: folder.is_dir() and any(folder.glob(pattern))


def _stop_in_phases(phases: dict[str, Phase], how: str, tmp_path: Path,
                    then: Callable[[str], str] = lambda phase: "") -> dict[str, dict]:
    """Start every command at once, each in its own session; stop each `how` once it is in its
    phase; wait for all, and note what each printed and left running (_finish). Then (in the
    same threads) `then(phase)`: a follow-up command's failure, or ''."""
    send = STOPS[how][0]
    runs = {}
    for name, (argv, env, ready, delay) in phases.items():
        env, slug = marked_env(env), name.replace(" ", "-")
        out, err = tmp_path / f"{slug}.out", tmp_path / f"{slug}.err"
        p = subprocess.Popen(argv, env=env, stdout=open(out, "w"), stderr=open(err, "w"),
                             start_new_session=True, preexec_fn=default_sigint)
        runs[name] = {"p": p, "out": out, "err": err, "env": env, "argv": argv, "sent": False}

    def stop(name: str, run: dict, ready: Callable[[dict], bool], delay: float) -> None:
        deadline = time.monotonic() + 120
        while run["p"].poll() is None and not ready(run) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        if run["p"].poll() is None:
            send(run["p"].pid)
            run["sent"] = True
        _finish(run)
        run["then"] = then(name)

    threads = [threading.Thread(target=stop, args=(name, runs[name], ready, delay))
               for name, (_, _, ready, delay) in phases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs


def _check_stopped(runs: dict[str, dict], how: str, *, leaves: Callable[[str], list[str]]) -> None:
    """Each run was stopped in its phase, ended as `how` must, and left no process;
    `leaves(phase)` lists the files it must not have left."""
    _, code, stderr = STOPS[how]
    failures = []
    for name, run in runs.items():
        where = f"{how} while {name}"
        if run["left"]:
            failures.append(f"{where}: processes left behind: {run['left']}")
        elif not run["sent"]:
            failures.append(f"{where}: it ended before the signal, status {run['code']}: {run['stderr'][-2000:]}")
        elif run["code"] != code or run["stderr"] != stderr:
            failures.append(f"{where}: status {run['code']} (not {code}), stderr {run['stderr'][-2000:]!r}")
        elif run["then"]:
            failures.append(f"{where}: the next command failed: {run['then']}")
        elif left := leaves(name):
            failures.append(f"{where}: left {left}")
    assert not failures, "\n".join(failures)


def _slug(name: str) -> str:
    return name.replace(" ", "-")


# A build's phases, by what it printed last: its fork server importing torch, its workers
# tracing, and this process writing a traced rank into the cache.
BUILD_PHASES = {
    "the fork server starts": ("tracing in ", 0.0),
    "tracing": ("rank 0: tracing", 0.5),
    "writing": (": writing", 0.0),
}


# The run's Ctrl-C stays in the default tier; the rest join the long one (CI time).
@pytest.mark.slow
@pytest.mark.parametrize("how", STOPS)
def test_each_stop_in_each_phase_of_a_build_leaves_nothing(how, tmp_path):
    """SIGINT and SIGTERM leave nothing at all. SIGKILL runs nothing in the build: its processes
    die with it, and the temps it was writing are removed by the next build that writes there
    (runtime/common/abandoned_temps.py), which then succeeds."""
    def cache_env(name: str) -> dict:
        return dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / f"cache-{_slug(name)}"), PYTHONUNBUFFERED="1")

    def argv(name: str) -> list[str]:
        return [sys.executable, "-m", "titan.cli.build", *BUILD, "--out", str(tmp_path / f"art-{_slug(name)}")]

    def build_again(name: str) -> str:
        if how != "sigkill":
            return ""
        again = subprocess.run(argv(name), env=cache_env(name), capture_output=True, text=True, timeout=600)
        return "" if again.returncode == 0 else again.stderr[-2000:]

    phases = {name: (argv(name), cache_env(name), _printed(text), delay)
              for name, (text, delay) in BUILD_PHASES.items()}
    with _load():
        runs = _stop_in_phases(phases, how, tmp_path, then=build_again)

    def leaves(name: str) -> list[str]:
        cache = tmp_path / f"cache-{_slug(name)}"
        left = [str(p) for p in tmp_path.iterdir() if p.name.startswith(f".art-{_slug(name)}")]
        left += [str(p) for p in (cache / "tmp").iterdir()]
        if how != "sigkill":  # (else built again)
            left += [str(p) for p in (tmp_path / f"art-{_slug(name)}", *(cache / "entries").iterdir()) if p.exists()]
        verify = titan("cache", "verify", env=cache_env(name))
        return left + ([f"a cache that fails to verify: {verify.stdout}{verify.stderr}"] if verify.returncode else [])
    _check_stopped(runs, how, leaves=leaves)


# A run's phases, by what it printed or wrote last: its ranks starting, stepping (a metrics
# line), writing a checkpoint (every step: one is always being written).
RUN_PHASES = {
    "the ranks start": (lambda tmp: _printed("starting 2 rank(s)"), 1.0),
    "stepping": (lambda tmp: _has_line(tmp / "stepping.jsonl"), 0.2),
    "writing a checkpoint": (lambda tmp: _exists(tmp / "ckpt-writing-a-checkpoint", ".step-*.partial"), 0.0),
}


# Ctrl-C in the default tier; the other signals join the long one (CI time).
@pytest.mark.parametrize("how", [h if h == "ctrl-c" else pytest.param(h, marks=pytest.mark.slow) for h in STOPS])
def test_each_stop_in_each_phase_of_a_run_leaves_nothing(how, debug_artifact, tmp_path):
    """SIGINT and SIGTERM leave no process and no partial checkpoint. After SIGKILL the ranks die
    with the launcher, and the next save in that checkpoint directory removes the partial one."""
    art = debug_artifact(tp=2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def argv(name: str, *more: str) -> list[str]:
        return [sys.executable, "-m", "titan.cli.run", str(art), "--checkpoint-dir", str(tmp_path / f"ckpt-{_slug(name)}"),
                "--checkpoint-every", "1", *more]

    def save_again(name: str) -> str:
        if how != "sigkill":
            return ""
        from titan.runtime.checkpoint import complete_steps
        done = complete_steps(tmp_path / f"ckpt-{_slug(name)}")
        more = ("--resume", "--steps", str(done[-1] + 1)) if done else ("--steps", "1")
        again = subprocess.run(argv(name, *more), env=env, capture_output=True, text=True, timeout=600)
        return "" if again.returncode == 0 else again.stderr[-2000:]

    phases = {name: (argv(name, "--steps", "100000", "--metrics", str(tmp_path / f"{_slug(name)}.jsonl")), env,
                     ready(tmp_path), delay)
              for name, (ready, delay) in RUN_PHASES.items()}
    with _load():
        runs = _stop_in_phases(phases, how, tmp_path, then=save_again)

    def leaves(name: str) -> list[str]:
        from titan.runtime.checkpoint import complete_steps, step_path
        left = [str(p) for p in tmp_path.glob(f"ckpt-{_slug(name)}/.*")]
        steps = complete_steps(tmp_path / f"ckpt-{_slug(name)}")
        hint = f"last checkpoint: {step_path(tmp_path / f'ckpt-{_slug(name)}', steps[-1])}" if steps else \
            "no checkpoint was completed"
        if how != "sigkill" and hint not in runs[name]["stdout"]:
            left.append(f"no word of where to resume ({hint!r}): {runs[name]['stdout'][-500:]!r}")
        return left
    _check_stopped(runs, how, leaves=leaves)


def _on_a_terminal(argv: list[str], env: dict, ready: Callable[[bytes], bool]) -> tuple[int, bytes]:
    """Run `argv` with a terminal as its stdin/stdout/stderr, Ctrl-C it (its group) once `ready`
    holds for what it printed; its status and all it printed."""
    import pty
    import select

    env = marked_env(dict(env, TERM="xterm"))
    main_fd, side = pty.openpty()
    p = subprocess.Popen(argv, env=env, stdin=side, stdout=side, stderr=side, start_new_session=True,
                         preexec_fn=default_sigint)
    os.close(side)
    out, sent, deadline = b"", False, time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            if not sent and ready(out):
                os.killpg(p.pid, signal.SIGINT)
                sent = True
            if select.select([main_fd], [], [], 0.05)[0]:
                try:
                    chunk = os.read(main_fd, 65536)
                except OSError:  # every writer is gone
                    break
                if not chunk:
                    break
                out += chunk
        return p.wait(timeout=60), out
    finally:
        os.close(main_fd)
        kill_all(p.pid, env)


def test_interrupted_starts_a_line_of_its_own_after_a_status_line(debug_artifact, tmp_path):
    """On a terminal, Ctrl-C while a build's or a run's status line is shown: `interrupted`
    comes on a line of its own, not after the status line's text."""
    art = debug_artifact(tp=2)
    build = [sys.executable, "-m", "titan.cli.build", *BUILD, "--out", str(tmp_path / "art")]
    run = [sys.executable, "-m", "titan.cli.run", str(art), "--steps", "100000"]
    results = {}

    def interrupt(name: str, argv: list[str], env: dict, shown: bytes) -> None:
        results[name] = _on_a_terminal(argv, env, lambda out: shown in out.rsplit(b"\n", 1)[-1])

    threads = [threading.Thread(target=interrupt, args=(
                   "build", build, dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache")), b"tracing")),
               threading.Thread(target=interrupt, args=("run", run, dict(os.environ), b"step"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (code, out) in results.items():
        assert code == 130, f"{name}: status {code}: {out[-2000:]!r}"
        assert out.endswith(b"\r\ninterrupted\r\n"), f"{name}: {out[-500:]!r}"
        assert b"\r" in out.rsplit(b"\r\ninterrupted", 1)[0].rsplit(b"\n", 1)[-1], f"{name}: no status line: {out[-500:]!r}"

"""Ctrl-C (and SIGTERM) that is correct at every instant of a command.

Python's default turns SIGINT into a KeyboardInterrupt raised at whatever bytecode runs. At the
wrong instant that unwinds a half-done import (numpy's lazy modules then fail with
RecursionError), crosses C++ code that called back into Python (pybind11 turns it into
std::terminate: SIGABRT), or is swallowed by a finalizer or an `except BaseException` (the
interrupt is lost and the command finishes). So titan raises none: every command calls
`install()` first, before click, numpy or torch are imported (titan/cli/__init__.py), and from
then on the handler itself ends the process: it runs the undo actions the command registered
(`on_interrupt`: stop child processes, remove temp directories), prints one `interrupted`
(SIGTERM: `terminated`) and calls os._exit. Nothing unwinds, so nothing half-imported or
half-written is left behind and nothing can swallow the signal. The few short sections that
must not be cut (a rename into place, a cache record) run under `deferred()`: a signal there
ends the process when the section ends.

Child processes (the build's trace workers, titan-run's ranks) are started under
`children_ignore_ctrl_c()`: SIGINT is blocked in the starting thread, and the mask is inherited
through fork and exec. The terminal sends Ctrl-C to the whole foreground process group; it so
reaches only the command, which stops its children with SIGTERM (then SIGKILL): they print
nothing. A process that is itself a rank or a worker exits quietly on a signal (its launcher
reports).

Standard library only: the runtime and every command import it first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
STOP_GRACE_S = 5.0

_undo: list[Callable[[], None]] = []
_deferred = 0
_pending: int | None = None
_quiet = False


def install(*, quiet: bool = False) -> None:
    """End this process cleanly on SIGINT / SIGTERM from now on. `quiet`: print nothing (a rank
    or worker whose launcher reports). A no-op outside the main thread (signal handlers can only
    be set there) and when SIGINT is ignored (a background job of a non-interactive shell)."""
    global _quiet
    _quiet = quiet
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in EXIT_CODES:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _handler)


def on_interrupt(undo: Callable[[], None]) -> Callable[[], None]:
    """Run `undo` if a signal ends the process (most recent first); returns a function that
    forgets it again (call it when the work it undoes is committed or cleaned up)."""
    _undo.append(undo)

    def forget() -> None:
        with contextlib.suppress(ValueError):
            _undo.remove(undo)
    return forget


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A section a signal does not cut: the process ends when the section does."""
    global _deferred
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1
        if not _deferred and _pending is not None:
            _exit(_pending)


@contextlib.contextmanager
def children_ignore_ctrl_c() -> Iterator[None]:
    """Processes and threads started inside inherit a blocked SIGINT (see the module doc).
    Nothing inside may unblock it: multiprocessing's resource tracker does when it starts (start
    it first, e.g. by making the pool's queue before this block)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()), "SIGINT was unblocked inside"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_processes(pids: list[int], *, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each live process, wait up to `grace_s` for all, SIGKILL the rest; reaps them.
    Plain os calls only: it runs inside the signal handler, which may have cut any lock holder."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if not _reaped(pid)]
        if alive:
            time.sleep(0.02)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _live_parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process (Linux /proc)."""
    parents = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendant_pids() -> list[int]:
    """This process's live descendants, deepest first (a child's children stop before it, so
    none is left to another parent)."""
    parents = _live_parents()
    found, frontier = [], [os.getpid()]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found = frontier + found
    return found


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child, or already reaped
        return not _exists(pid)
    return done == pid


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _handler(signum: int, frame) -> None:
    global _pending
    if _deferred:
        if _pending is None:
            _pending = signum
        return
    _exit(signum)


def _exit(signum: int) -> None:
    # Block both signals: a second Ctrl-C must not cut the undo actions.
    signal.pthread_sigmask(signal.SIG_BLOCK, set(EXIT_CODES))
    for undo in reversed(_undo):
        with contextlib.suppress(BaseException):
            undo()
    for stream in (sys.stdout, sys.stderr):  # what the command printed so far, then the one line
        with contextlib.suppress(BaseException):  # the handler may have cut a write to it
            stream.flush()
    if not (_quiet or _is_worker()):
        with contextlib.suppress(OSError):
            os.write(2, f"{WORDS[signum]}\n".encode())
    os._exit(EXIT_CODES[signum])


def _is_worker() -> bool:
    """A multiprocessing child (a build's trace worker): its name is set before it imports
    anything of titan's. The signal may land while multiprocessing itself is half imported (its
    names not bound yet): then this process has started no worker and is none."""
    process = sys.modules.get("multiprocessing.process")
    current = getattr(process, "_current_process", None)
    return getattr(current, "name", "MainProcess") != "MainProcess"

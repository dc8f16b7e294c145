"""The trace processes of a build: forked from one server that imported torch and the tracer
once (builder/preload), one fresh process per task, `--jobs` at a time, each reporting its stages;
and stopping all of them, whatever ends the build."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from typing import TYPE_CHECKING, Callable

from titan.runtime.common import interrupt, parent_death

if TYPE_CHECKING:
    from titan.builder.spec.build_spec import BuildSpec

QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


def trace_context():
    """Trace processes are forked from one server that has imported torch and the tracer once
    (builder/trace/preload.py): a fresh process for every task (rank_trace.py says why) that does
    not import torch again. The server lives as long as this process, so later builds in it
    start their traces at once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["titan.builder.trace.preload"])
    _short_socket_dir()
    return ctx


def _short_socket_dir() -> None:
    """multiprocessing puts the fork server's socket in its own temp directory, made in the temp
    directory: the private one (runtime/common/compiler_caches.py) under a long TITAN_CACHE_DIR can
    pass the 107 bytes a socket path may have. It makes that directory once per process with
    mkdtemp (a random name, mode 0700, safe in a shared /tmp): make it in the system's."""
    import multiprocessing.util
    import tempfile

    from titan.runtime.common.compiler_caches import system_tmp

    saved, tempfile.tempdir = tempfile.tempdir, system_tmp()
    try:
        multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def trace_in_processes(spec: BuildSpec, tasks: list[tuple[int, tuple[int | None, ...]]], jobs: int,
           on_stage: Callable[[int, str], None]):
    """Yield RankResults as tasks finish; a task (rank, depths) traces one rank at those depths
    in a fresh process (see rank_trace.py). Tasks start in the order given, each on the first free
    worker. The processes report their stages (rank_progress.py), passed on to `on_stage`
    meanwhile."""
    from titan.builder.trace.job import RankJob
    from titan.builder.trace.rank_job import start_trace_process, trace_job

    if not tasks:
        return
    ctx = trace_context()
    # After a Ctrl-C ends this process (os._exit skips the finalizers of the pool's semaphores),
    # multiprocessing's resource tracker unlinks them, as it should, and warns about each: its
    # interpreter takes this process's -W options, so that expected cleanup stays silent.
    if QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_TRACKER)
    # A Ctrl-C stops the workers from here (runtime/common/interrupt.py): they start with SIGINT blocked.
    forget = interrupt.on_interrupt(stop_workers)
    # The queue starts multiprocessing's resource tracker, whose start unblocks SIGINT in the
    # calling thread when it is done: so it comes before the block below, not inside it.
    stages = ctx.Queue()
    with interrupt.children_ignore_ctrl_c():  # the pool's threads, the fork server and every worker inherit it
        _start_fork_server()
        pool = cf.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(tasks))), mp_context=ctx,
                                      max_tasks_per_child=1, initializer=start_trace_process, initargs=(stages,))
        pending = {pool.submit(trace_job, RankJob(build=spec, rank=r, depths=d)) for r, d in tasks}
    with pool:
        while pending:
            finished, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            while True:
                try:
                    on_stage(*stages.get_nowait())
                except queue.Empty:
                    break
            for fut in finished:
                yield from fut.result()
    stop_fork_server()
    forget()


def _start_fork_server() -> None:
    """Start the fork server from this (the main) thread, told to die with this process
    (builder/trace/preload.py): the pool would start it from whichever thread first needs it, and
    the kernel's parent-death signal follows the death of that thread."""
    from multiprocessing import forkserver

    os.environ[parent_death.PARENT_PID_ENV] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[parent_death.PARENT_PID_ENV]


def stop_fork_server() -> None:
    """End the fork server with the tracing: left to notice this process's exit, it would shut
    its interpreter down (torch loaded) for about a second after titan-build returned. A later
    build in this process starts a new one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)  # nothing in it to flush: its children have all exited
    server._stop()


def trace_tasks(todo: dict[int, tuple[int | None, ...]], jobs: int) -> list[tuple[int, tuple[int | None, ...]]]:
    """The (rank, depths) tasks for the ranks and depths to trace, in the order to start them.

    A task is one process, and a process's first trace costs more than its later ones (0.25 s
    for 8B to 0.65 s for 671B of torch's first-call work, measured 2026-11-25), so a rank's
    depths share a process where the workers still finish together: the schedule the pool will
    run (each task on the first free worker) is planned here, a task costing about its depth in
    layers. Ranks longest first each go to the least loaded worker, as many of their depths
    (longest first) as fit under an even share of the whole; the rest go on to the next least
    loaded one. Tasks start in their planned start order; a task's depths are traced shortest
    first, as with one task per rank. (A process never traces two ranks: rank_trace.py says
    why.) 8B --tp 4 on two workers: 4 processes instead of 10."""
    if len(todo) <= jobs:
        tasks = [(r, depths) for r, depths in todo.items()]
        return sorted(tasks, key=lambda t: -_cost(t[1]))
    share = sum(_cost(depths) for depths in todo.values()) / jobs
    loads = [0] * jobs
    planned = []  # (start, rank, depths)
    for rank, depths in sorted(todo.items(), key=lambda t: -_cost(t[1])):
        left = sorted(depths, key=lambda d: -_cost((d,)))
        while left:
            worker = min(range(jobs), key=lambda w: loads[w])
            taken = [left.pop(0)]
            while left and loads[worker] + _cost(taken) + _cost(left[:1]) <= share:
                taken.append(left.pop(0))
            planned.append((loads[worker], rank, tuple(sorted(taken, key=lambda d: _cost((d,))))))
            loads[worker] += _cost(taken)
    return [(rank, depths) for _, rank, depths in sorted(planned, key=lambda t: t[0])]


def _cost(depths) -> int:
    """What tracing these depths costs, in layers (a full-depth trace, None: one unit)."""
    return sum(d or 1 for d in depths)


def stop_workers() -> None:
    """On a signal: stop every descendant, then let multiprocessing's resource tracker unlink
    the pool's semaphores and end, so that nothing outlives this process.

    The tracker is told apart by its pid: every process multiprocessing starts has the same
    interpreter flags (the fork server's, which the processes it forks keep), so no command
    line tells them apart (issue 33: a filter on one spared them all). Descendants are stopped
    until two looks find none (the pool's thread may be starting one right now, and a worker
    is a child before multiprocessing lists it: it would then find its start data missing and
    print a traceback); a worker the server forks meanwhile dies with it (preload.py).
    The fork server's lock is taken first and kept: the pool's thread, replacing a finished
    worker, would otherwise start a new server once this one is gone."""
    import threading
    from multiprocessing import forkserver, resource_tracker

    # The pool's thread fails as its processes go; this process ends anyway: no traceback.
    threading.excepthook = lambda args: None
    forkserver._forkserver._lock.acquire(timeout=interrupt.STOP_GRACE_S)
    tracker = resource_tracker._resource_tracker
    quiet = 0
    for _ in range(40):
        workers = [pid for pid in interrupt.descendant_pids() if pid != tracker._pid]
        if workers:
            interrupt.stop_processes(workers)
            quiet = 0
        else:
            quiet += 1
            if quiet == 2:
                break
            time.sleep(0.05)
    _end_resource_tracker(tracker)


def _end_resource_tracker(tracker) -> None:
    """Close this process's end of the tracker's pipe (the workers' ends are closed: they are
    gone), so that it unlinks what the pool left registered and exits; wait for that. Its lock
    is not taken: the signal may have cut the thread that holds it."""
    fd, pid = tracker._fd, tracker._pid
    if fd is None or pid is None:
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    tracker._fd = tracker._pid = None
    deadline = time.monotonic() + interrupt.STOP_GRACE_S
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)

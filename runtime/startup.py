"""What a run does before its first step, said while it does it, and the one paragraph that
ends it (issue 33: 13-20 s of silence before step 1, no summary after the last).

A start-up phase that lasts over a second prints its line while it runs (from a timer, so a
fast phase prints nothing); every phase's time is kept for the summary. When the job started
is the launcher's start (titan-run, titan-verify), torchrun's agent's, or else this process's:
`job_started` says which, so that the start-up recorded for the "last time" hint is the same
span whatever started the ranks.

Standard library only: the runtime imports it before torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import threading
import time
from typing import Callable, Iterator

STARTED_ENV = "TITAN_RUN_STARTED"
"""Set by titan-run / titan-verify for the ranks they spawn: the launcher's start (unix seconds)."""


def _process_start(pid: int | str) -> float | None:
    """Unix time a process started, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def job_started() -> float:
    """When the job started, as a person would time it: titan-run's launcher start, else
    torchrun's (its agent is this rank's parent), else this process's start."""
    if STARTED_ENV in os.environ:
        try:
            return float(os.environ[STARTED_ENV])
        except ValueError:
            pass
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for the ranks its agent starts
        agent = _process_start(os.getppid())
        if agent is not None:
            return agent
    return _process_start("self") or time.time()


class Phases:
    """A command's start-up phases: `with phases("loading the program"):` prints that line if
    the phase is still running after `after_s`, and records its time."""

    def __init__(self, say: Callable[[str], None] | None, *, after_s: float = 1.0):
        self.say, self.after_s = say, after_s
        self.times: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, what: str, *, short: str | None = None) -> Iterator[None]:
        """`what`: the line while it runs; `short`: its name in the summary (default `what`)."""
        timer = None
        if self.say is not None:
            timer = threading.Timer(self.after_s, self.say, (f"{what} ...",))
            timer.daemon = True
            timer.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
            self.times.append((short or what, time.perf_counter() - t0))

    def breakdown(self, *, at_least: float = 0.1) -> str:
        """'torch import 2.1 s, program 0.8 s' (the phases of at least `at_least` seconds)."""
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.times if s >= at_least)


def say_rank0(text: str) -> None:
    print(text, file=sys.stdout, flush=True)


def peak_memory_text(device_type: str, gpu_peak_bytes: int | None) -> str:
    """This rank's peak memory: the CUDA allocator's peak on GPU, the process's peak resident
    size on CPU."""
    if device_type == "cuda" and gpu_peak_bytes is not None:
        return f"peak GPU memory {gpu_peak_bytes / 2**30:.1f} GiB (rank 0)"
    try:
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return ""
    return f"peak memory {kib / 2**20:.1f} GiB resident (rank 0)"


def summary(*, steps_run: int, total_steps: int, wall_s: float, startup_s: float | None, phases: Phases,
            tokens_per_s: list[float], first_loss: tuple[int, float] | None, last_loss: tuple[int, float] | None,
            memory: str, mfu: str = "") -> str:
    """The paragraph that ends a run."""
    parts = [f"done: {steps_run} step(s) in {wall_s:.1f} s"]
    if startup_s is not None:
        detail = phases.breakdown()
        parts.append(f"start-up {startup_s:.1f} s to the end of the first step" + (f" ({detail})" if detail else ""))
    if tokens_per_s:
        parts.append(f"median {statistics.median(tokens_per_s):,.0f} tokens/s")
    if first_loss is not None and last_loss is not None:
        parts.append(f"loss {first_loss[1]:.4f} at step {first_loss[0]}, {last_loss[1]:.4f} at step {last_loss[0]}")
    if memory:
        parts.append(memory)
    if mfu:
        parts.append(mfu)
    return "; ".join(parts) + "."


@functools.cache
def rank_phases() -> Phases:
    """This process's start-up phases (one per process); only rank 0 says them."""
    return Phases(say_rank0 if os.environ.get("RANK", "0") == "0" else None)


def launcher_phase(phases: Phases) -> None:
    """Add the time a titan-run / titan-verify launcher spent before it spawned this rank (its
    checks and its own torch import) to this rank's phases, as the first."""
    try:
        started, spawned = float(os.environ[STARTED_ENV]), float(os.environ[SPAWNED_ENV])
    except (KeyError, ValueError):
        return
    phases.times.insert(0, ("checks before the ranks started", spawned - started))


SPAWNED_ENV = "TITAN_RUN_SPAWNED"
"""Set by titan-run / titan-verify for the ranks they spawn: when they spawned them (unix seconds)."""

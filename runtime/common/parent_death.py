"""Every process a titan command starts dies with its parent, however the parent ends.

On SIGINT / SIGTERM a command stops its children itself (runtime/common/interrupt.py), but nothing
runs in a process that gets SIGKILL (the OOM killer, a scheduler's kill, `kill -9`): its
children would be re-parented to init and keep running, blocked for ever on a pipe that no one
reads (issue 33 found a build's fork server and a trace worker, ~350 MB each, hours later).
So each child asks the kernel for SIGKILL when its parent dies (Linux PR_SET_PDEATHSIG), then
checks that its parent is still the process that started it: a parent that died before that
call would never send the signal.

The signal follows the death of the parent *thread* that forked the child, not of the process:
children are started from a thread that lives as long as the process (titan's main thread,
the fork server's only thread).

How a child learns whom to die with: an exec'd child (a titan-run rank, the build's fork
server) reads its parent's pid from PARENT_PID_ENV (`child_env`, `from_environment`); a
forked child knows it already (`forked_children_die_with_parent`).

Standard library only: every command imports it first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "TITAN_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_forking_pid: int | None = None


def die_with_parent(parent_pid: int) -> None:
    """Be killed (SIGKILL) when the parent dies; end now if `parent_pid` is no longer the parent.
    Without PR_SET_PDEATHSIG (not Linux) only the check is made."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the call (we were re-parented)
        os._exit(1)


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for an exec'd child that dies with this process (it calls `from_environment`)."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def from_environment() -> None:
    """In an exec'd child: die with the parent PARENT_PID_ENV names, if it names one. The variable
    is removed, so that a process this one starts is not bound to its grandparent."""
    pid = os.environ.pop(PARENT_PID_ENV, None)
    if pid is not None and pid.isdigit():
        die_with_parent(int(pid))


def forked_children_die_with_parent() -> None:
    """Every process forked from this one from now on (and from those, ...) dies with its parent,
    from its first instruction after the fork."""
    def before() -> None:
        global _forking_pid
        _forking_pid = os.getpid()

    def after_in_child() -> None:
        assert _forking_pid is not None
        die_with_parent(_forking_pid)

    os.register_at_fork(before=before, after_in_child=after_in_child)

"""Where the compilers titan drives keep their caches: one private directory per user, set in
the environment before anything can read it.

Inductor, Triton and torch's extension builder cache generated code on disk and load it from
there: Python modules, shared objects, precompiled headers, cubins, pickles. Their defaults are
not safe for titan's promise that no one else's code runs in your job: inductor's is
`$TMPDIR/torchinductor_<user>`, which any local user can create first (a module planted there
is imported by the victim's next compile, issue 29), and some of inductor's files ignore
TORCHINDUCTOR_CACHE_DIR and follow the temp directory alone (its precompiled headers, fixed at
import of torch._inductor.codecache). So every titan command calls `install()` first
(titan/cli/__init__.py, before torch is imported; the build's fork server too), which points all
of them, and the temp directory itself, into `private_root()`:

    $TITAN_CACHE_DIR/private/         (default ~/.cache/titan/private; with a shared cache,
                                       TITAN_SHARED_CACHE=1, compiler-caches/ beside the user's
                                       key file instead, default ~/.config/titan/: a directory
                                       others can write cannot hold a private one)
        inductor/  triton/{cache,dump,override}/  torch_extensions/  cuda/  tmp/

The root is made by titan (mode 0700), must be a directory owned by the user that no one else
can enter, not a link, inside a parent no one else can rename it out of; `ensure()` says in one
line what is wrong. Inductor's remote caches (shared by whoever can reach the server) are
switched off. Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

SHARED_ENV = "TITAN_SHARED_CACHE"
COMPILER_DIRS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",  # generated modules, .so files, FX graph and AOTAutograd caches
    "TRITON_CACHE_DIR": "triton/cache",  # default ~/.triton/cache (and under inductor's cache when inductor drives)
    "TRITON_DUMP_DIR": "triton/dump",
    "TRITON_OVERRIDE_DIR": "triton/override",  # TRITON_KERNEL_OVERRIDE=1 loads kernels from here
    "TORCH_EXTENSIONS_DIR": "torch_extensions",  # torch.utils.cpp_extension builds (default ~/.cache)
    "CUDA_CACHE_PATH": "cuda",  # the CUDA driver's JIT cache of PTX (default ~/.nv/ComputeCache)
    "TMPDIR": "tmp",  # tempfile.gettempdir(): inductor's default cache and precompiled headers follow it
}
"""Each environment variable the compilers read a cache location from, and its place under
the private root."""
REMOTE_CACHES_OFF = ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
                     "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE")
"""Inductor's caches on a server: what others put there would be loaded (pickles)."""
REPRODUCIBLE = {"TRITON_DISABLE_LINE_INFO": "1"}
"""Triton's line info names the generated source's path, which lies under this private root: the
same kernel compiled by two users, or by a build host and a GPU host (titan-build --kernels
--gpu), would differ in bytes. Without it their cubins are identical. Set in the environment,
where inductor's compile workers (other processes) read it too."""

_problem: str | None = None
_system_tmp: str | None = None


class PrivateDirError(ValueError):
    """The compiler caches cannot be kept private; the message says how to fix it."""


def private_root() -> Path:
    """The one place the compilers' caches go (see the module docstring)."""
    if os.environ.get(SHARED_ENV, "") == "1":
        from titan.runtime.common.environment import key_file
        return key_file().parent / "compiler-caches"
    return Path(os.environ.get("TITAN_CACHE_DIR") or "~/.cache/titan").expanduser() / "private"


def install() -> None:
    """Point every compiler cache (and the temp directory) into the private root and make it;
    a problem is kept for `ensure()` to report (this runs at import, where no error can be
    said properly). Idempotent."""
    global _problem, _system_tmp
    root = private_root().absolute()
    if _system_tmp is None:
        _system_tmp = os.environ.get("TMPDIR") or "/tmp"
    for var, sub in COMPILER_DIRS.items():
        os.environ[var] = str(root / sub)
    for var in REMOTE_CACHES_OFF:
        os.environ[var] = "0"
    os.environ.update(REPRODUCIBLE)
    try:
        _make(root)
        _problem = None
    except PrivateDirError as e:
        _problem = str(e)
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile.tempdir = None  # computed again from TMPDIR at its next use


def ensure() -> Path:
    """The private root, made and checked, with the environment pointing into it: called where
    a compile can follow (titan-build, titan-run, titan-verify, and before inductor is
    imported). PrivateDirError (one line, with the fix) if it cannot be private."""
    root = private_root().absolute()
    if (_problem is not None or any(os.environ.get(v) != str(root / s) for v, s in COMPILER_DIRS.items())
            or any(os.environ.get(v) != value for v, value in REPRODUCIBLE.items())):
        install()
    if _problem is not None:
        raise PrivateDirError(_problem)
    return root


def system_tmp() -> str:
    """The temp directory before install(): for what must stay short there (the build's fork
    server socket: a Unix socket path has at most 107 bytes). An inherited TMPDIR this user cannot
    write (another user's private one, kept by sudo or su) gives way to /tmp, as tempfile would."""
    inherited = _system_tmp or os.environ.get("TMPDIR")
    for candidate in (inherited, "/tmp", "/var/tmp"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    return inherited or "/tmp"


def _make(root: Path) -> None:
    fix = "or set TITAN_CACHE_DIR to a directory of your own"
    try:
        root.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(root)
        parent = os.stat(root.parent)
    except OSError as e:
        raise PrivateDirError(f"cannot make the private compiler cache {root}: {e.strerror or e}; {fix}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"{root} is not a directory titan made (planted?); remove it, {fix}")
    if st.st_uid != os.geteuid():
        raise PrivateDirError(f"{root} is owned by uid {st.st_uid}, not you (planted?); remove it, {fix}")
    if st.st_mode & 0o077:
        raise PrivateDirError(f"{root} can be used by others (mode {stat.S_IMODE(st.st_mode):o}); run chmod 700 {root}, "
                              f"{fix}")
    # Whoever can write the parent (without the sticky bit) can rename the root away and put
    # their own in its place after this check: the parent must be the user's (or root's) alone.
    others = 0o002 if os.environ.get(SHARED_ENV, "") == "1" else 0o022
    if parent.st_uid not in (0, os.geteuid()) or (parent.st_mode & others and not parent.st_mode & stat.S_ISVTX):
        raise PrivateDirError(f"{root.parent} can be written by others, who could replace {root}; run chmod go-w "
                              f"{root.parent}, {fix}")
    for sub in sorted(set(COMPILER_DIRS.values())):
        path = root
        for part in Path(sub).parts:
            path = path / part
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise PrivateDirError(f"cannot make {path}: {e.strerror or e}; {fix}") from None

"""A cache shared by two users (docs/trust.md, "Shared caches"): real processes under two real
uids of one group. Nothing one user's maintenance does loses what the other built, directories
titan makes under the default umask are writable by the group, and no lock holder makes a build
wait for ever.

The two users are made here when the tests run as root (useradd; skipped otherwise). They run
titan through setpriv with their own uid, gids and umask 022, keeping only the capability to
read and search directories (CAP_DAC_READ_SEARCH), because the interpreter lives under /root:
every write, rename and delete is checked against their own uid and groups."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

GROUP = "titan-share"
USERS = ("titan-alice", "titan-bob")
SINGLE = ("--flavor", "debug")


def _ensure_users() -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("useradd"):
        pytest.skip("needs root (to make two users) and setpriv")
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True)
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", GROUP, user],
                           check=True)


class User:
    def __init__(self, name: str, home, cache):
        self.name, self.uid = name, pwd.getpwnam(name).pw_uid
        home.mkdir()
        os.chown(home, self.uid, pwd.getpwnam(name).pw_gid)
        self.env = dict(os.environ, HOME=str(home), TITAN_CACHE_DIR=str(cache), TITAN_SHARED_CACHE="1",
                        TITAN_KEY_FILE=str(home / "cache.key"))
        self.prefix = ["setpriv", f"--reuid={name}", f"--regid={name}", "--init-groups",
                       "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]

    def popen(self, *argv, **env) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix, sys.executable, *map(str, argv)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(self.env, **env),
                                preexec_fn=lambda: os.umask(0o022), cwd="/")

    def titan(self, command: str, *args, **env) -> subprocess.CompletedProcess:
        p = self.popen("-m", f"titan.cli.{command}", *args, **env)
        out, err = p.communicate(timeout=600)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture(scope="module")
def team():
    """A shared cache as docs/trust.md says to make one (group-owned, setgid, group-writable),
    and alice's and bob's builds of the same debug model in it."""
    _ensure_users()
    # In /tmp, outside pytest's 0700 directory and any private TMPDIR this process has (importing
    # titan points it into the test cache): access(2), which option checks use, ignores
    # capabilities. The users inherit that TMPDIR, which they cannot write: titan must cope.
    root = Path(tempfile.mkdtemp(prefix="titan-shared-", dir="/tmp"))
    os.chmod(root, 0o755)
    yield from _team(root)
    shutil.rmtree(root)


def _team(root):
    cache = root / "cache"
    cache.mkdir()
    os.chown(cache, 0, grp.getgrnam(GROUP).gr_gid)
    os.chmod(cache, 0o2775)
    alice, bob = User(USERS[0], root / "alice", cache), User(USERS[1], root / "bob", cache)
    for user in (alice, bob):
        out = root / f"art-{user.name}"
        out.mkdir()
        os.chown(out, user.uid, -1)
        r = user.titan("build", *SINGLE, "--out", out / "a")
        assert r.returncode == 0 and "cache: miss" in r.stdout, r.stdout + r.stderr
    yield cache, alice, bob, root


def _hit(user: User, root) -> bool:
    r = user.titan("build", *SINGLE, "--out", root / f"art-{user.name}" / "a")
    assert r.returncode == 0, r.stdout + r.stderr
    return "cache: hit" in r.stdout


def test_directories_titan_makes_are_group_writable_and_setgid_under_umask_022(team):
    cache, alice, bob, root = team
    share = grp.getgrnam(GROUP).gr_gid
    for sub in ("blobs", "entries", "ranks", "used", "locks", "tmp"):
        st = os.stat(cache / sub)
        assert st.st_gid == share and stat.S_IMODE(st.st_mode) == 0o2775, (sub, oct(st.st_mode))
    prefixes = list((cache / "blobs").iterdir())
    assert prefixes and all(stat.S_IMODE(p.stat().st_mode) == 0o2775 for p in prefixes)
    # Both users wrote into directories the other made: one entry each, under their own uid.
    names = sorted(p.name for p in (cache / "entries").iterdir())
    assert [n.split("@")[1] for n in names] == sorted([f"{alice.uid}.json", f"{bob.uid}.json"])


def test_maintenance_by_one_user_keeps_what_the_other_built(team):
    cache, alice, bob, root = team
    before = {p.name for p in (cache / "blobs").glob("*/*")}
    v = bob.titan("cache", "verify", "--remove")
    assert v.returncode == 0 and "records of other users kept as theirs" in v.stdout, v.stdout + v.stderr
    gc = bob.titan("cache", "gc", "--max-size", "0", "--older-than", "0s")
    assert gc.returncode == 0 and "removed" in gc.stdout, gc.stdout + gc.stderr
    assert {p.name for p in (cache / "blobs").glob("*/*")} == before, "bob's gc removed blobs alice's entry names"
    assert not any(p.name.endswith(f"@{bob.uid}.json") for p in (cache / "entries").iterdir())
    assert _hit(alice, root)
    v = alice.titan("cache", "verify")
    assert v.returncode == 0 and "0 tampered" in v.stdout, v.stdout
    assert not _hit(bob, root)  # bob's own entry went to his gc; his rebuild brings it back
    assert _hit(bob, root)


def test_a_record_named_for_another_uid_is_planted_and_verify_removes_it(team):
    cache, alice, bob, root = team
    (mine,) = (cache / "entries").glob(f"*@{alice.uid}.json")
    forged = cache / "entries" / mine.name.replace(f"@{alice.uid}", "@1")  # named for uid 1, owned by alice
    p = alice.popen("-c", f"import shutil; shutil.copyfile({str(mine)!r}, {str(forged)!r})")
    assert p.wait() == 0
    v = bob.titan("cache", "verify")
    assert v.returncode == 1 and "not owned by uid 1 (planted?)" in v.stdout, v.stdout
    assert bob.titan("cache", "verify", "--remove").returncode == 1 and not forged.exists()
    assert mine.exists()


def _hold(user: User, lock) -> subprocess.Popen:
    """A process of `user` holding an flock on `lock` (creating it) until killed."""
    p = user.popen("-c", "import fcntl, os, sys, time\n"
                         f"fd = os.open({str(lock)!r}, os.O_RDONLY | os.O_CREAT, 0o644)\n"
                         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)")
    assert p.stdout.readline().strip() == "held", p.stderr.read()
    return p


def test_a_lock_planted_by_another_user_is_replaced_and_ones_own_is_waited_for_a_bounded_time(team):
    cache, alice, bob, root = team
    key = json.loads((root / f"art-{alice.name}" / "a" / "manifest.json").read_text())["cache_key"]
    lock = cache / "locks" / f"{key}@{alice.uid}.lock"
    lock.unlink(missing_ok=True)
    (cache / "entries" / f"{key}@{alice.uid}.json").unlink()  # so that alice's build needs the lock
    holder = _hold(bob, lock)
    try:
        t0 = time.monotonic()
        r = alice.titan("build", *SINGLE, "--out", root / f"art-{alice.name}" / "a")
        assert r.returncode == 0 and "waiting" not in r.stdout, r.stdout + r.stderr
        assert time.monotonic() - t0 < 120
    finally:
        holder.kill()
        holder.wait()
    (cache / "entries" / f"{key}@{alice.uid}.json").unlink()
    holder = _hold(alice, lock)  # alice's own stuck process: named, waited for TITAN_LOCK_WAIT seconds
    try:
        r = alice.titan("build", *SINGLE, "--out", root / f"art-{alice.name}" / "a", TITAN_LOCK_WAIT="2")
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"waiting for pid {holder.pid} (python" in r.stdout and "user titan-alice" in r.stdout, r.stdout
    assert "still holds this build's lock after 2 s; building without it" in r.stdout

"""The compilers' caches are private (runtime/common/compiler_caches.py, issue 29): modules another
user plants where inductor's and Triton's defaults would be are never read by a titan process,
and every entry point points the caches into the private root before torch is imported."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import titan

# What each entry point leaves in its process: where every library will put its cache. The
# first also imports inductor's code cache (which fixes some of its paths at import) and asks it;
# the others need only the environment and the temp directory the libraries follow.
PROBE = """
import json, os, sys, tempfile
{entry}
where = {{v: os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_DUMP_DIR",
                                        "TRITON_OVERRIDE_DIR", "TORCH_EXTENSIONS_DIR", "CUDA_CACHE_PATH")}}
where["tempdir"] = tempfile.gettempdir()
if {deep}:
    import torch._inductor.codecache as codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
    where.update({{"inductor": cache_dir(), "inductor default": default_cache_dir(),
                  "precompiled headers": codecache._HEADER_DIR}})
where["remote"] = os.environ.get("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE")
print(json.dumps(where))
"""
ENTRIES = {
    "console script / python -m": ("import titan.cli.run", True),
    "a spawned or torchrun rank": ("os.environ['RANK'] = '0'; import titan.cli.run", False),
    "the group command": ("import titan.cli.titan", False),
    "the build's fork server": ("import titan.builder.trace.preload", False),
}


@pytest.fixture
def planted(tmp_path):
    """A temp directory and a home another user got to first: inductor's default cache
    ($TMPDIR/torchinductor_<user>) and Triton's (~/.triton/cache) exist, holding modules."""
    tmp, home = tmp_path / "shared-tmp", tmp_path / "home"
    for d in (tmp / f"torchinductor_{getpass.getuser()}" / "ab", home / ".triton" / "cache" / "ab"):
        d.mkdir(parents=True)
        (d / "planted.py").write_text("raise SystemExit('planted module ran')\n")
    env = dict(os.environ, TMPDIR=str(tmp), HOME=str(home), TITAN_CACHE_DIR=str(tmp_path / "cache"),
               CANARY=str(tmp_path / "canary"))
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    return tmp, home, env


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_entry_point_points_every_compiler_cache_into_the_private_root(planted, tmp_path, entry):
    tmp, home, env = planted
    before = _tree(tmp) | _tree(home)
    r = subprocess.run([sys.executable, "-c", PROBE.format(entry=ENTRIES[entry][0], deep=ENTRIES[entry][1])], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    where = json.loads(r.stdout.strip().splitlines()[-1])
    private = tmp_path / "cache" / "private"
    remote = where.pop("remote")
    assert remote == "0"
    for what, path in where.items():
        assert Path(path).is_relative_to(private), f"{what}: {path}"
    assert _tree(tmp) | _tree(home) == before, "a default cache location was touched"
    assert (private.stat().st_mode & 0o777) == 0o700


def test_private_root_that_others_can_enter_or_that_is_a_link_is_refused_in_one_line(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = dict(os.environ, TITAN_CACHE_DIR=str(cache))
    (cache / "private").mkdir(mode=0o755)
    (cache / "private").chmod(0o755)
    r = titan("run", tmp_path / "nowhere", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "can be used by others" in r.stderr and "chmod 700" in r.stderr
    (cache / "private").rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (cache / "private").symlink_to(tmp_path / "elsewhere")
    r = titan("build", "--flavor", "debug", env=env)
    assert r.returncode == 2 and "is not a directory titan made (planted?)" in r.stderr, r.stderr
    assert not list((tmp_path / "elsewhere").iterdir())


# One fusion region (x * 2 + 1 on 64 floats), compiled by inductor: `unprotected` compiles it as
# a process that is no titan command would, `titan` through the titan entry point and fusion.py.
REGION = """
import os, sys, torch, torch.fx as fx
if sys.argv[1] == "titan":
    import titan.cli  # every titan command's first import
import titan.runtime.kernels.fusion as fusion

def f(x):
    return x * 2 + 1

gm = fx.symbolic_trace(f)
for n in gm.graph.nodes:
    if n.op == "placeholder":
        n.meta["titan_val"] = {"shape": [64], "stride": [1], "dtype": "float32"}
    elif n.op == "call_function":
        n.meta["titan_region"] = "block#0"
if sys.argv[1] == "titan":
    from titan.runtime.store.kernel_store import KernelStore
    sources = fusion.KernelSources(device=torch.device("cpu"), store=KernelStore(__import__("pathlib").Path(sys.argv[2])))
    fusion.compile_regions(gm, device=torch.device("cpu"), sources=sources, stats=fusion.FusionStats(), memo={})
    out = gm(torch.ones(64))
else:
    run = fusion._runs(gm)[0]
    inputs, outputs = fusion._boundary(run)
    from torch._inductor import standalone_compile
    compiled = standalone_compile(fusion._extract(run, inputs, outputs), [torch.ones(64)],
                                  dynamic_shapes="from_example_inputs")
    out = compiled(torch.ones(64))[0]
assert torch.equal(out, torch.full((64,), 3.0))
"""


@pytest.mark.slow
def test_modules_planted_in_inductors_default_cache_run_in_a_plain_process_and_never_in_titan(planted, tmp_path):
    tmp, _, env = planted
    canary = Path(env["CANARY"])

    def region(how: str, tmpdir: Path):
        run_env = dict(env, TMPDIR=str(tmpdir))
        r = subprocess.run([sys.executable, "-c", REGION, how, str(tmp_path / "kernel-store")], env=run_env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]

    # The attacker compiles the region as the victim would, under a temp directory of their
    # own, and plants what inductor wrote, each generated module made to leave a canary.
    recon = tmp_path / "recon"
    recon.mkdir()
    region("unprotected", recon)
    default = f"torchinductor_{getpass.getuser()}"
    shutil.rmtree(tmp / default)
    shutil.copytree(recon / default, tmp / default)
    modules = list((tmp / default).rglob("*.py"))
    assert modules
    for module in modules:
        module.write_text(f"open({str(canary)!r}, 'a').write('ran\\n')\n" + module.read_text())
    before = _tree(tmp)
    # A process that is not titan compiles the region and runs the planted code: the attack is real.
    region("unprotected", tmp)
    assert canary.exists(), "the planted modules were not imported: this test could not catch the attack"
    canary.unlink()
    before = _tree(tmp)
    # titan compiles it into its private caches and never reads the planted ones.
    region("titan", tmp)
    assert not canary.exists(), "a titan process imported a module planted in inductor's default cache"
    assert _tree(tmp) == before, "a titan process wrote into the planted default cache"
    assert list((tmp_path / "cache" / "private" / "inductor").rglob("*.py")), "titan compiled nothing"


def test_a_shared_cache_keeps_no_private_directory_inside_it(tmp_path, monkeypatch):
    # Whoever can write a shared cache could rename a private directory inside it away after
    # titan checked it: with TITAN_SHARED_CACHE=1 the compilers' caches live beside the user's key.
    from titan.runtime.common.compiler_caches import private_root

    monkeypatch.setenv("TITAN_KEY_FILE", str(tmp_path / "config" / "cache.key"))
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "shared"))
    assert private_root() == tmp_path / "shared" / "private"
    monkeypatch.setenv("TITAN_SHARED_CACHE", "1")
    assert private_root() == tmp_path / "config" / "compiler-caches"

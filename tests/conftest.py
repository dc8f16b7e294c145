"""Shared fixtures of every tier (tests/README.md): real CLI processes and real debug artifacts,
built once per session; and the unit tier's one rule, enforced: its tests start no process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    # Every titan process the tests start shares one throwaway build cache, never the user's.
    os.environ["TITAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="titan-test-cache-")
    # ... and one signing key for cache records (never the user's own, ~/.config/titan/cache.key).
    os.environ["TITAN_KEY_FILE"] = os.path.join(tempfile.mkdtemp(prefix="titan-test-key-"), "cache.key")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is not None and gpus < mark.kwargs.get("count", 1):
            item.add_marker(pytest.mark.skip(reason=f"needs {mark.kwargs.get('count', 1)} CUDA GPU(s), found {gpus}"))


UNIT_TIER = Path(__file__).parent / "unit"


@contextlib.contextmanager
def _no_process_starts(nodeid: str):
    """Every way Python starts a process (subprocess, multiprocessing, os.fork, os.system) fails
    while the unit test `nodeid` runs, its fixtures' setup and teardown included."""
    import _posixsubprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"{nodeid} starts a process: unit tests run in process; "
                             "move it to tests/e2e (tests/README.md)")

    # subprocess binds fork_exec at import (Python >= 3.11); multiprocessing calls it through its module.
    starts = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec")]
    starts += [(os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")]
    saved = [(module, name, getattr(module, name)) for module, name in starts if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, refuse)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if UNIT_TIER in item.path.parents:
        with _no_process_starts(item.nodeid):
            yield
    else:
        yield


def titan(command: str, *args, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a titan command as a user would, in its own process."""
    return subprocess.run([sys.executable, "-m", f"titan.cli.{command}", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def assert_every_rank_equals_eager(art: Path, tmp_path: Path, *, steps: int, ranks: int, extra: tuple = ()) -> dict:
    """titan-verify of a debug artifact (with `extra` options, e.g. --data): every step's loss and
    every parameter after the last step torch.equal to eager on each of `ranks` ranks; returns
    its JSON result."""
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", steps, "--json", out, *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout
    assert f"parameters after step {steps}: all bitwise equal (21 tensors per rank, {ranks} ranks)" in r.stdout
    assert r.stdout.splitlines()[-1].startswith(f"done: {steps} step(s) eagerly and from the artifact in ")
    result = json.loads(out.read_text())
    assert result["parameters_differing"] == 0 and result["eager"] == result["artifact"]
    return result


def param_spec(fqn: str, global_shape: list[int], slices: list[list[int]]):
    """A parameter-table entry (what a rank record holds) for the shard `slices` cut."""
    from titan.runtime.contract.rank_record import ParamSpec
    from titan.runtime.contract.shards import shard_box
    return ParamSpec(fqn=fqn, global_shape=tuple(global_shape), local_shape=shard_box(slices, global_shape).local_shape,
                     placements={}, slices=tuple(map(tuple, slices)), init={"kind": "zeros"})


def own(name: str) -> str:
    """A cache record's, marker's or lock's file name stem for this user (runtime/store/record.py)."""
    return f"{name}@{os.geteuid()}"


def cache_record(path: Path) -> dict:
    """The JSON of a cache record file (after its `titan-record-v2 <mac>` header line)."""
    return json.loads(path.read_bytes().split(b"\n", 1)[1])


def read_metrics(path: Path) -> list[dict]:
    """The step records of a --metrics file (after its header line, the run's config)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert "config" in records[0], "a metrics file starts with the run's config"
    return records[1:]


def assert_resumes_bitwise(art: Path, tmp_path: Path) -> Path:
    """Train `art` 4 steps straight, then 2 steps checkpointed and 2 more resumed: the same losses,
    to the last bit. Returns the checkpoint directory."""
    whole, first, rest = (tmp_path / f"{n}.jsonl" for n in ("whole", "first", "rest"))
    ckpt = tmp_path / "ckpt"
    assert titan("run", art, "--steps", 4, "--metrics", whole).returncode == 0
    r = titan("run", art, "--steps", 2, "--checkpoint-dir", ckpt, "--checkpoint-every", 2, "--metrics", first)
    assert r.returncode == 0, r.stderr
    r = titan("run", art, "--steps", 4, "--checkpoint-dir", ckpt, "--resume", "--metrics", rest)
    assert r.returncode == 0, r.stderr
    losses = [rec["loss"] for rec in read_metrics(whole)]
    assert len(losses) == 4 and losses == [rec["loss"] for f in (first, rest) for rec in read_metrics(f)]
    return ckpt


@pytest.fixture(scope="session")
def debug_artifact(tmp_path_factory):
    """debug_artifact(tp=2, dp_shard=1, ...) -> path of a built debug artifact (built once)."""
    root = tmp_path_factory.mktemp("artifacts")
    built: dict[tuple, Path] = {}

    def get(*, tp: int = 1, dp_shard: int = 1, dp_replicate: int = 1, extra: tuple = ()) -> Path:
        key = (tp, dp_shard, dp_replicate, extra)
        if key not in built:
            out = root / f"tp{tp}-dps{dp_shard}-dpr{dp_replicate}{'-'.join(extra)}"
            r = titan("build", "--flavor", "debug", "--tp", tp, "--dp-shard", dp_shard,
                      "--dp-replicate", dp_replicate, "--out", out, *extra)
            assert r.returncode == 0, r.stderr
            built[key] = out
        return built[key]

    return get


def hf_round_trip(art: Path, hf_dir: Path, tmp_path: Path) -> Path:
    """Start `art` from the Hugging Face checkpoint in `hf_dir` (--steps 0 writes the initial
    state), export that checkpoint with titan-export, and check that every tensor came back bit
    for bit; returns the exported directory."""
    from safetensors.torch import load_file

    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    r = titan("run", art, "--init-from-hf", hf_dir, "--steps", 0, "--checkpoint-dir", ckpt)
    assert r.returncode == 0, r.stderr
    r = titan("export", ckpt, "--hf", out)
    assert r.returncode == 0, r.stderr
    original, written = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == written.keys()
    assert all(torch.equal(original[k], written[k]) for k in original)
    return out



def write_sidecar(path: Path, tokens: int, eos_id: int | None, *, vocab: int = 2048) -> None:
    """What titan-data writes beside a token file (runtime/data.py), for a separator `eos_id`."""
    from titan.runtime.data import sidecar_path
    sidecar_path(path).write_text(json.dumps({"format": "titan-tokens", "format_version": 1, "dtype": "uint16",
                                              "vocab_size": vocab, "tokens": tokens, "eos_id": eos_id}))


def write_documents(path: Path, *, vocab: int, eos: int) -> Path:
    """A token file (and its sidecar) of documents 3-90 tokens long, each followed by `eos`:
    every step's batch has its boundaries at other positions."""
    import numpy as np
    g = torch.Generator().manual_seed(7)
    parts, total = [], 0
    while total < 8192:
        doc = torch.randint(0, eos, (int(torch.randint(3, 91, (1,), generator=g)),), generator=g)
        parts += [doc, torch.tensor([eos])]
        total += len(doc) + 1
    path.write_bytes(torch.cat(parts).numpy().astype(np.uint16).tobytes())
    write_sidecar(path, total, eos, vocab=vocab)
    return path

"""Untrusted bytes are bounded before they expand (issue 29): graph blobs while msgpack decodes
them, manifests and program metadata on their raw bytes before JSON parses them, the number of
CPU ranks a host is asked to start, and a program's memory against its device before the
first step. Each bomb is loaded in its own process and its peak memory asserted; a good
artifact still loads."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from conftest import titan

PROBE = Path(__file__).parent.parent / "bomb_probe.py"


def _probe(kind: str, path: Path) -> dict:
    r = subprocess.run([sys.executable, PROBE, kind, path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def _graph_of_empty_arrays(path: Path) -> Path:
    """A 26 MiB graph blob of 2^20 'nodes', each an array of 23 empty arrays (one byte each):
    plain msgpack decoding made 1.7 GiB of Python lists of it (the issue's 24 MiB: +3.4 GiB)."""
    node = b"\xdc" + struct.pack(">H", 23) + b"\x90" * 23
    head = msgpack.packb({"format": "titan-graph", "version": 2, "constants": None}, use_bin_type=True)
    path.write_bytes(b"\x84" + head[1:] + msgpack.packb("nodes") + b"\xdd" + struct.pack(">I", 1 << 20)
                     + node * (1 << 20))
    return path


def test_a_graph_of_empty_arrays_is_refused_while_it_decodes(tmp_path):
    out = _probe("graph", _graph_of_empty_arrays(tmp_path / "bomb.tgraph"))
    assert "more than one list or map per 12 bytes" in out["error"]
    assert out["peak_mib"] < 250, out  # measured 160; plain msgpack: 1,744


def _relisted(art: Path, rel: str, data: bytes) -> None:
    """Replace an artifact file, hash-consistent with its manifest (as a crafted artifact is)."""
    (art / rel).write_bytes(data)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"][rel] = hashlib.sha256(data).hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def art_copy(debug_artifact, tmp_path) -> Path:
    art = tmp_path / "art"
    shutil.copytree(debug_artifact(), art)
    return art


def test_a_manifest_of_empty_lists_is_refused_before_it_is_parsed(art_copy):
    (art_copy / "manifest.json").write_bytes(b"[" + b"[]," * (5 << 20) + b"[]]")  # 15 MiB
    out = _probe("manifest", art_copy)
    assert "lists or objects" in out["error"] and "more than any document titan writes" in out["error"]
    assert out["peak_mib"] < 60, out  # the file itself (15 MiB); json.loads of it: ~380 MiB


def test_a_manifest_over_its_size_bound_is_not_read(art_copy):
    with open(art_copy / "manifest.json", "wb") as f:
        f.truncate(60 << 20)  # the 60 MiB manifest: 3.1 GiB when parsed
    out = _probe("manifest", art_copy)
    assert "over the bound of 16,777,216" in out["error"]
    assert out["peak_mib"] < 20, out


def test_program_metadata_of_empty_lists_is_refused_before_it_is_parsed(art_copy):
    manifest = json.loads((art_copy / "manifest.json").read_text())
    _relisted(art_copy, manifest["programs"][0]["meta"], b"[" + b"[]," * (5 << 20) + b"[]]")
    out = _probe("program", art_copy)
    assert "lists or objects" in out["error"]
    assert out["peak_mib"] < 60, out


def test_a_good_artifact_still_loads_on_every_rank(debug_artifact):
    out = _probe("good", debug_artifact(tp=2))
    assert out["error"] is None
    assert out["peak_mib"] < 300, out


def _world(art: Path, ranks: int) -> None:
    """Make a one-rank artifact claim `ranks` data-parallel replicas (a consistent manifest: its
    one program binds on every rank)."""
    m = json.loads((art / "manifest.json").read_text())
    m.update(world_size=ranks, mesh=[["dp_replicate", ranks]], rank_programs=[0] * ranks)
    m["layout"]["dp_replicate"] = ranks
    (art / "manifest.json").write_text(json.dumps(m))


def test_titan_run_refuses_more_cpu_ranks_than_the_host_can_run(art_copy):
    _world(art_copy, 4096)
    r = titan("run", art_copy, "--device", "cpu", "--steps", 1)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and "has 4,096 ranks, more than this host's" in line
    assert "run it on GPUs, across hosts with torchrun, or build a layout with fewer ranks" in line


def test_titan_run_refuses_a_program_the_host_memory_cannot_hold(art_copy):
    manifest = json.loads((art_copy / "manifest.json").read_text())
    rel = manifest["programs"][0]["meta"]
    meta = json.loads((art_copy / rel).read_text())
    meta["saved_bytes"] = 1 << 50  # 1 PiB of saved activations
    _relisted(art_copy, rel, json.dumps(meta).encode())
    r = titan("verify", art_copy, "--device", "cpu", "--steps", 1)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "the 1 rank(s) need at least 1048576.4 GiB" in line and "layout or batch, or run it on GPUs" in line


def test_a_rank_checks_its_graphs_memory_against_its_device(debug_artifact):
    """Before the first step, from the loaded graphs: the saved activations are those the
    build reported, and a program larger than the device is one line with the fix."""
    import dataclasses

    import torch

    from titan.runtime.contract.artifact import open_artifact
    from titan.runtime.contract.memory_estimate import check_device, estimate_from_graphs, estimate_from_record
    from titan.runtime.rank_graphs import load_rank_graphs

    art = open_artifact(debug_artifact())
    record = art.rank_record(0)
    fw, bw = load_rank_graphs(art, 0, device=torch.device("cpu"), groups={})
    estimate = estimate_from_graphs(record, fw, bw)
    assert estimate.activations >= record.saved_bytes == estimate_from_record(record).activations > 0
    check_device(estimate, torch.device("cpu"), name="debug")
    with pytest.raises(ValueError, match=r"needs at least .* GiB per rank .* --ac full"):
        check_device(dataclasses.replace(estimate, activations=1 << 50), torch.device("cpu"), name="debug")

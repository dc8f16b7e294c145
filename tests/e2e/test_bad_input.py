"""Bad input gets one clear line saying how to fix it, a non-zero exit, and loses nothing."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import titan


def _error_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines, "expected an error message"
    return lines[-1]


@pytest.mark.parametrize("args, words", [
    (("--model", "gpt9"), ["unknown model", "llama3"]),
    (("--flavor", "13B"), ["unknown flavor", "debug", "8B"]),
    (("--flavor", "debug", "--tp", "3"), ["--tp 3 does not divide", "heads"]),
    (("--flavor", "debug", "--dp-shard", "0"), ["invalid value for '--dp-shard'", "x>=1"]),
    (("--flavor", "debug", "--tp", "2", "--seq-len", "127"), ["--seq-len 127", "divisible by --tp 2"]),
])
def test_build_rejects_bad_model_or_layout(args, words, tmp_path):
    out = tmp_path / "out"
    r = titan("build", *args, "--out", out)
    assert r.returncode == 2
    line = _error_line(r)
    assert line.startswith("error: ")
    for w in words:
        assert w in line, line
    assert not out.exists(), "a failed build must write nothing"


@pytest.mark.parametrize("args, words", [
    (("--gpu", "h100"), ["--gpu h100 names the GPU", "add --kernels"]),
    (("--kernels", "--gpu", "sm90"), ["unknown GPU", "an architecture alone", "h100, h200"]),
    (("--kernels", "--gpu", "h100"), ["not a CUDA build", "pip install torch==2.11.0 triton==3.6.0"]),
])
def test_build_for_a_named_gpu_refuses_what_it_cannot_build(args, words, tmp_path):
    """titan-build --kernels --gpu NAME (kernels built without a GPU) refuses an unknown GPU, a
    missing --kernels, and this CPU build of torch, in one line before anything is traced."""
    import torch
    if torch.version.cuda is not None and "--kernels" in args and "h100" in args:
        pytest.skip("this torch is a CUDA build: it can build for the H100")
    out = tmp_path / "out"
    r = titan("build", "--flavor", "debug", *args, "--out", out)
    assert r.returncode == 2
    line = _error_line(r)
    assert line.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in line, line
    assert "building" not in r.stdout and not out.exists(), "refused before anything is traced"


def test_build_refuses_to_overwrite_a_non_artifact_directory(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = titan("build", "--flavor", "debug", "--out", out)
    assert r.returncode == 2
    assert "is not a titan artifact" in _error_line(r)
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.fixture
def tp2_copy(debug_artifact, tmp_path):
    dst = tmp_path / "art"
    shutil.copytree(debug_artifact(tp=2), dst)
    return dst


def _edit_json(path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=1))


def _run_one_step_error(art) -> str:
    r = titan("run", art, "--steps", 1)
    assert r.returncode == 2
    return _error_line(r)


def test_run_rejects_world_size_mismatch(tp2_copy):
    env = dict(os.environ, RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    r = titan("run", tp2_copy, "--steps", 1, env=env)
    assert r.returncode == 2
    line = _error_line(r)
    assert "built for world size 2" in line and "3 ranks" in line


def test_run_rejects_missing_file(tp2_copy):
    graph = next((tp2_copy / "graphs").iterdir())
    graph.unlink()
    r = titan("run", tp2_copy, "--steps", 1)
    assert r.returncode == 2
    line = _error_line(r)
    assert "is missing" in line and "rebuild" in line


def test_run_rejects_edited_file(tp2_copy):
    meta = json.loads((tp2_copy / "manifest.json").read_text())["programs"][0]["meta"]
    _edit_json(tp2_copy / meta, lambda d: d["params"][0]["init"].update(std=0.5))
    assert "does not match its sha256" in _run_one_step_error(tp2_copy)


def test_run_rejects_other_torch_version(tp2_copy):
    _edit_json(tp2_copy / "manifest.json", lambda d: d.update(torch_version="2.11.0+cu130"))
    line = _run_one_step_error(tp2_copy)
    assert "built with torch 2.11.0" in line and "rebuild" in line


def test_run_rejects_batch_shape_that_differs_from_the_build(tp2_copy):
    r = titan("run", tp2_copy, "--seq-len", 64)
    assert r.returncode == 2
    assert "--seq-len 64 differs from the artifact's 128" in _error_line(r)


def test_run_rejects_a_directory_that_is_not_an_artifact(tmp_path):
    r = titan("run", tmp_path)
    assert r.returncode == 2
    assert "is not a titan artifact" in _error_line(r)


def test_run_on_cuda_without_gpu_says_so(tp2_copy):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    r = titan("run", tp2_copy, "--device", "cuda")
    assert r.returncode == 2
    assert "no CUDA GPU" in _error_line(r) and "--device cpu" in _error_line(r)


def test_run_refuses_a_graph_that_is_not_its_programs(tp2_copy):
    def swap(d):
        program = d["programs"][0]
        program["forward"], program["backward"] = program["backward"], program["forward"]
    _edit_json(tp2_copy / "manifest.json", swap)
    assert "never run another program's graph" in _run_one_step_error(tp2_copy)


def test_run_rejects_another_artifact_format_version(tp2_copy):
    _edit_json(tp2_copy / "manifest.json", lambda d: d.update(format_version=1))
    line = _run_one_step_error(tp2_copy)
    assert "artifact format 1" in line and "rebuild it with this version's titan-build" in line

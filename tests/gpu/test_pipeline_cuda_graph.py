"""A pipeline rank's whole step as one CUDA graph (runtime/captured_pipeline.py) on two GPUs over
NCCL: titan-verify --deterministic bitwise equal to torch.distributed.pipelining with the graph
and without it, for a schedule of each kind (the zero-bubble one splits its backwards), and the
captured run's losses equal to the op-by-op run's step for step; FlexAttention's document mask on
every stage likewise."""

from __future__ import annotations

import json

import pytest

from conftest import titan, write_documents

SCHEDULES = ["1f1b", "gpipe", "interleaved-1f1b", "zbv"]


def _verify(art, tmp_path, name, *flags) -> dict:
    out = tmp_path / f"{name}.json"
    r = titan("verify", art, "--steps", 6, "--device", "cuda", "--deterministic", "--max-norm", "1.0",
              "--json", out, *flags)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_step_captured_bitwise_equal_to_eager_pipeline(schedule, tmp_path):
    art = tmp_path / f"pp2-{schedule}"
    r = titan("build", "--flavor", "debug", "--n-layers", 8, "--dtype", "bf16", "--pp", 2,
              "--pp-schedule", schedule, "--microbatches", 4, "--out", art)
    assert r.returncode == 0, r.stderr
    captured = _verify(art, tmp_path, "graph")
    op_by_op = _verify(art, tmp_path, "nograph", "--no-cuda-graphs")
    assert captured["bitwise_equal"] and op_by_op["bitwise_equal"]
    assert captured["artifact"] == op_by_op["artifact"] == captured["eager"]


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_flex_document_pipeline_captured_bitwise_equal_to_eager_pipeline(schedule, tmp_path):
    """FlexAttention's document mask on every stage (each reads the micro-batch's tokens: the ids
    are computed in the captured step, on the device), boundaries elsewhere in every micro-batch:
    one graph captured, replayed with each step's boundaries."""
    data = write_documents(tmp_path / "documents.u16", vocab=2048, eos=2047)
    art = tmp_path / f"pp2-flexdoc-{schedule}"
    # The GPU kernels take a sequence that is a multiple of 128.
    r = titan("build", "--flavor", "debug", "--n-layers", 8, "--dtype", "bf16", "--pp", 2, "--pp-schedule", schedule,
              "--microbatches", 4, "--attention", "flex", "--mask", "document", "--eos-id", 2047, "--out", art)
    assert r.returncode == 0, r.stderr
    captured = _verify(art, tmp_path, "graph", "--data", data)
    op_by_op = _verify(art, tmp_path, "nograph", "--no-cuda-graphs", "--data", data)
    assert captured["bitwise_equal"] and op_by_op["bitwise_equal"]
    assert captured["artifact"] == op_by_op["artifact"] == captured["eager"]


@pytest.mark.gpu(count=4)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_dp_shard_stages_gathered_once_per_step_captured_bitwise_equal_to_eager_pipeline(schedule, tmp_path):
    """pp 2 x dp-shard 2 on four GPUs: each stage's parameters all-gathered once per step
    (runtime/stage_gather.py, inside the captured step) bitwise equal to eager SimpleFSDP gathering
    in every micro-batch, with the graph and without it, and to the stored graphs run as they are."""
    art = tmp_path / f"pp2-fsdp2-{schedule}"
    r = titan("build", "--flavor", "debug", "--n-layers", 8, "--dtype", "bf16", "--pp", 2, "--dp-shard", 2,
              "--pp-schedule", schedule, "--microbatches", 4, "--out", art)
    assert r.returncode == 0, r.stderr
    captured = _verify(art, tmp_path, "graph")
    op_by_op = _verify(art, tmp_path, "nograph", "--no-cuda-graphs")
    per_microbatch = _verify(art, tmp_path, "permb", "--no-pp-gather-per-step")
    assert captured["bitwise_equal"] and op_by_op["bitwise_equal"] and per_microbatch["bitwise_equal"]
    assert captured["artifact"] == op_by_op["artifact"] == per_microbatch["artifact"] == captured["eager"]

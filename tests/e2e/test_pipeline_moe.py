"""DeepSeek-V3 pipeline artifacts with expert parallelism: titan-verify of `titan-build --model
deepseek_v3 --pp 2 --ep 2` is bitwise equal to PyTorch's own torch.distributed.pipelining
(PipelineStage and the schedule class, each stage's MoE dispatching over its own ep ranks:
cli/tools/eager_pipeline.py): every step's loss and gradient norm, every parameter and every MoE
buffer (balancing bias, expert load) on every rank, 10 steps. The buffers change in each forward,
and a pipeline runs several micro-batches' forwards before their backwards: a runtime that
updated them after the backward, or an eager reference that let torch's shape inference route a
placeholder batch, would differ from the first step on. (The same with Llama 3:
e2e/test_pipeline_artifacts.py.)"""

from __future__ import annotations

import json

import pytest

from conftest import read_metrics, titan

STEPS = 10


@pytest.mark.slow
@pytest.mark.parametrize("layout, buffers", [
    (("--pp", "2", "--microbatches", "3"), 12),  # stages: layers 0-1 (dense, MoE) and 2 (MoE)
    (("--n-layers", "4", "--pp", "2", "--pp-schedule", "zbv", "--microbatches", "3"), 18),  # one layer a stage
], ids=["1f1b", "zbv"])
def test_a_deepseek_pipeline_with_expert_parallel_trains_bitwise_as_torch_pipelining(layout, buffers, tmp_path):
    art = tmp_path / "art"
    r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", "--ep", "2", *layout, "--out", art)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", STEPS, "--max-norm", "0.2", "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout
    assert f"model buffers after step {STEPS}: all bitwise equal ({buffers} tensors on 4 ranks)" in r.stdout
    result = json.loads(out.read_text())
    assert result["eager"] == result["artifact"] and len(set(result["artifact"])) == STEPS
    assert result["parameters_differing"] == 0 and result["buffers_differing"] == 0
    # titan-run logs the expert load of rank 0's stages (read after the step).
    metrics = tmp_path / "m.jsonl"
    r = titan("run", art, "--steps", 2, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    records = read_metrics(metrics)
    assert [rec["loss"] for rec in records] == [float.fromhex(x) for x in result["artifact"][:2]]
    assert all(rec["expert_load_max"] >= rec["expert_load_mean"] > 0 and rec["dropped_tokens"] == 0
               for rec in records)

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

from conftest import assert_resumes_bitwise, read_metrics, titan

STEPS = 10
ONE_F_ONE_B = ("--pp", "2", "--microbatches", "3")  # stages: layers 0-1 (dense, MoE) and 2 (MoE)


def _build(out, *layout):
    r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", "--ep", "2", *layout, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def pp2_ep2(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("ds") / "art", *ONE_F_ONE_B)


def _verify_and_run(art, tmp_path, *, buffers: int):
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
    r = titan("run", art, "--steps", 2, "--max-norm", "0.2", "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    records = read_metrics(metrics)
    assert [rec["loss"] for rec in records] == [float.fromhex(x) for x in result["artifact"][:2]]
    assert all(rec["expert_load_max"] >= rec["expert_load_mean"] > 0 and rec["dropped_tokens"] == 0
               for rec in records)


@pytest.mark.slow
def test_a_1f1b_deepseek_pipeline_with_expert_parallel_trains_bitwise_as_torch_pipelining(pp2_ep2, tmp_path):
    _verify_and_run(pp2_ep2, tmp_path, buffers=12)


@pytest.mark.slow
def test_a_zero_bubble_deepseek_pipeline_with_expert_parallel_trains_bitwise_as_torch_pipelining(tmp_path):
    # One block a stage: rank 0 holds stages 0 (dense) and 3, rank 1 stages 1 and 2 (zbv's V).
    art = _build(tmp_path / "art", "--n-layers", "4", "--pp", "2", "--pp-schedule", "zbv", "--microbatches", "3")
    _verify_and_run(art, tmp_path, buffers=18)


@pytest.mark.slow
def test_a_checkpointed_deepseek_stage_recomputes_from_the_bias_its_forward_read(tmp_path):
    # --ac full saves the balancing bias itself for the backward's recomputation, and stage 0
    # runs two micro-batches' forwards (each moving the bias) before the first one's backward.
    _verify_and_run(_build(tmp_path / "art", *ONE_F_ONE_B, "--ac", "full"), tmp_path, buffers=12)


@pytest.mark.slow
def test_a_deepseek_pipeline_resumes_bitwise_with_every_stages_buffers_and_exports_them(pp2_ep2, tmp_path):
    ckpt = assert_resumes_bitwise(pp2_ep2, tmp_path)
    # The checkpoint describes every stage's buffers, and the export carries both MoE blocks' bias.
    state = json.loads(next(ckpt.glob("step-*/titan.json")).read_text())
    assert {f"layers.{i}.feed_forward.expert_bias" for i in (1, 2)} <= set(state["buffers"])
    r = titan("export", ckpt, "--hf", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    names = load_file(tmp_path / "hf" / "model.safetensors").keys()
    assert {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)} <= names


def _verified_then_run(art, tmp_path, *, steps: int, run_steps: int, verify: tuple = (),
                       buffers: str = "") -> list[dict]:
    """titan-verify `art` bitwise (losses, parameters and model buffers, `buffers` the count it
    must say; clip 0.2, below the debug model's norms), then titan-run's metrics of its first
    `run_steps`, whose losses must be titan-verify's."""
    out = tmp_path / "verify.json"
    r = titan("verify", art, *verify, "--steps", steps, "--max-norm", "0.2", "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout and f"model buffers after step {steps}: all bitwise equal{buffers}" in r.stdout
    result = json.loads(out.read_text())
    assert result["eager"] == result["artifact"] and result["parameters_differing"] == 0
    metrics = tmp_path / "m.jsonl"
    r = titan("run", art, "--steps", run_steps, "--max-norm", "0.2", "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    records = read_metrics(metrics)
    assert [rec["loss"] for rec in records] == [float.fromhex(x) for x in result["artifact"][:run_steps]]
    return records


@pytest.mark.slow
def test_a_drop_and_pad_deepseek_pipeline_drops_as_torch_pipelining_dropping_at_the_same_capacity(tmp_path):
    # Capacity 0.5: every step drops assignments on both stages' MoE blocks, so a reference that
    # did not drop (or dropped at another capacity) would differ from step 1 on.
    art = _build(tmp_path / "art", *ONE_F_ONE_B, "--moe-capacity", "0.5", "--moe-drop")
    r = titan("verify", art, "--steps", 1)
    assert r.returncode != 0 and r.stderr.count("error:") == 1 and "--moe-drop" in r.stderr, r.stdout + r.stderr
    records = _verified_then_run(art, tmp_path, steps=3, run_steps=2, verify=("--moe-drop",),
                                 buffers=" (12 tensors on 4 ranks)")
    assert all(rec["dropped_tokens"] > 0 for rec in records)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [
    ONE_F_ONE_B,
    # One block a stage: rank 0 holds stages 0 (dense: no dispatch, no redo) and 3, a V.
    ("--n-layers", "4", "--pp", "2", "--pp-schedule", "zbv", "--microbatches", "3"),
], ids=["1f1b", "zbv"])
def test_a_bounded_deepseek_pipeline_redoes_each_overflowing_stage_forward_and_stays_dropless(schedule, tmp_path):
    """Capacity 1.05: some micro-batches' forwards overflow on a stage and are redone by its
    dropless program (its backward too, split in zbv), the others keep the bounded results. The
    reference is the dropless model under torch.distributed.pipelining: bitwise equal either way."""
    art = _build(tmp_path / "art", *schedule, "--moe-capacity", "1.05")
    records = _verified_then_run(art, tmp_path, steps=4, run_steps=4)
    redone = [rec["moe_redone"] for rec in records]  # rank 0's stages: 3 MoE forwards a step
    assert sum(redone) > 0 and min(redone) < 3, redone
    assert all(rec["dropped_tokens"] == 0 for rec in records)

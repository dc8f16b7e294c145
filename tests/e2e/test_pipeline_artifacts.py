"""Pipeline artifacts trained as a user trains them: titan-verify of a `titan-build --pp` artifact
is bitwise equal to PyTorch's own torch.distributed.pipelining (PipelineStage and the schedule
class the artifact names, on the same split, parallelized alike: cli/tools/eager_pipeline.py),
every step's loss and gradient norm and every parameter on every rank, with clipping whose norm
spans the stages; a checkpointed pipeline resumes bitwise and exports one Hugging Face
checkpoint of every stage. (The executor against torch on stage programs alone:
e2e/test_pipeline_bitwise.py; the records: unit/test_pipeline_records.py.)"""

from __future__ import annotations

import json
import re

import pytest

from conftest import assert_resumes_bitwise, read_metrics, titan

FOUR_LAYERS = ("--flavor", "debug", "--n-layers", "4")


def _build(tmp_path, *layout) -> str:
    out = tmp_path / "art"
    r = titan("build", *FOUR_LAYERS, *layout, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def _verify_bitwise(art, tmp_path, *, ranks: int, steps: int = 6, options: tuple = ()) -> dict:
    out = tmp_path / "verify.json"
    # max-norm 0.2: below the debug model's norms (0.3-0.8), so the clip, whose norm spans the stages, acts.
    r = titan("verify", art, "--steps", steps, "--max-norm", "0.2", "--json", out, *options)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout and f"{ranks} ranks)" in r.stdout
    result = json.loads(out.read_text())
    norms = [float.fromhex(x) for x in result["artifact_grad_norm"]]
    assert result["eager"] == result["artifact"] and len(set(result["artifact"])) == steps
    assert min(norms) > 0.2, norms
    return result


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """A 1F1B pp 2 artifact of 4 layers, 3 micro-batches (built once for this file's default tests)."""
    return _build(tmp_path_factory.mktemp("pp2"), "--pp", "2", "--microbatches", "3")


def test_a_1f1b_pipeline_trains_bitwise_as_torch_pipelining(pp2, tmp_path):
    _verify_bitwise(pp2, tmp_path, ranks=2)


def test_the_regions_of_stages_gathered_once_are_the_gpu_run_s_own(tmp_path):
    """bf16 stages have fusion regions around the parameters' casts; gathering once per step (the
    default) moves those casts out, and what is left of each region still extracts and keys as
    the GPU run compiles it (a moved value's input must not claim a region: found before a GPU
    run, where it made every pipeline with regions fail to load)."""
    import torch

    from titan.runtime.contract.artifact import open_artifact
    from titan.runtime.kernels.fusion import region_kernels
    from titan.runtime.rank_graphs import load_rank_graphs
    from titan.runtime.stage_gather import gather_once

    art = open_artifact(_build(tmp_path, "--dtype", "bf16", "--pp", "2", "--microbatches", "2"), check_torch=False)
    groups = {dim: f"group-{dim}" for dim, _ in art.layout.mesh_shape()}
    for stage in range(2):
        load = lambda: load_rank_graphs(art, stage, device=torch.device("cpu"), groups=groups, stage=stage)  # noqa: E731
        stored = [set(region_kernels(gm, device="gpu")) for gm in load()]
        cut = gather_once(*load(), n_params=len(art.rank_record(stage, stage=stage).params))
        assert all(n.op != "placeholder" or "titan_region" not in n.meta for n in cut.forward.graph.nodes)
        gathered = [set(region_kernels(gm, device="gpu")) for gm in (cut.forward, cut.backward)]
        # The forward's regions that read a parameter's cast are keyed anew; the rest are the same kernels.
        assert stored[0] and gathered[0] and stored[0] != gathered[0] and stored[0] & gathered[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout, ranks", [
    (("--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "3", "--pp-split", "3,1"), 2),
    (("--pp", "2", "--pp-schedule", "interleaved-1f1b", "--microbatches", "4"), 2),
    (("--pp", "2", "--pp-schedule", "zbv", "--microbatches", "5"), 2),
    (("--pp", "2", "--tp", "2"), 4),
], ids=["gpipe-uneven", "interleaved-v2", "zbv", "pp2-tp2"])
def test_every_schedule_and_layout_trains_bitwise_as_torch_pipelining(layout, ranks, tmp_path):
    _verify_bitwise(_build(tmp_path, *layout), tmp_path, ranks=ranks)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, microbatches", [("1f1b", 4), ("zbv", 5)])
def test_dp_shard_stages_gathered_once_per_step_train_bitwise_as_torch_gathering_per_micro_batch(
        schedule, microbatches, tmp_path):
    """pp 2 x dp-shard 2: titan-run's stages all-gather their parameters once per step (runtime/
    stage_gather.py); torch's schedules run SimpleFSDP's gathers in every micro-batch's forward.
    Bitwise equal over 10 steps, with a quarter (a fifth) of the all-gathers."""
    out = tmp_path / "art"
    r = titan("build", *FOUR_LAYERS, "--pp", "2", "--dp-shard", "2", "--pp-schedule", schedule,
              "--microbatches", microbatches, "--out", out)
    assert r.returncode == 0, r.stderr
    assert re.search(r"pp rank 0: .* GiB gathered parameters \+", r.stdout), r.stdout  # the memory report counts them
    _verify_bitwise(out, tmp_path, ranks=4, steps=10)
    if schedule == "1f1b":  # and as the stage graphs are stored, gathering in every micro-batch
        _verify_bitwise(out, tmp_path, ranks=4, steps=3, options=("--no-pp-gather-per-step",))
    shown = titan("show", out, "--graph", "fw")
    assert shown.returncode == 0, shown.stderr
    counts = re.findall(r"stage \d+: (\d+) all-gathers?, (\d+) reduce-scatters \(parameters gathered once per step"
                        r".*\); (\d+) all-gathers, (\d+) reduce-scatters \(gathered in every micro-batch", shown.stdout)
    assert counts, shown.stdout
    for once, rs_once, every, rs_every in counts:
        assert int(once) * microbatches == int(every) > 0 and rs_once == rs_every


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--dp-shard", "2"), ("--dp-shard", "2", "--tp", "2"),
                                    ("--dp-replicate", "2", "--dp-shard", "2")],
                         ids=["pp2-dp2", "pp2-dp2-tp2", "pp2-hsdp"])
def test_reducing_once_per_step_trains_as_the_default_within_rounding_with_fewer_reductions(layout, tmp_path):
    """titan-run --pp-reduce-per-step (numerics change: each stage sums its micro-batches' unreduced
    gradients, then reduces once, where the default reduces each micro-batch's and sums the
    results): pp 2 x dp-shard 2 (x tp 2: its reduce-scatters of activation gradients stay in every
    micro-batch; or x 2 replicas: their all-reduces move too), zbv on 5 micro-batches, 10 steps.
    Every step's loss within 1e-6 relative of the default's and its gradient norm within 1e-5
    (fp32; seen: 1.2e-7 and 9e-8), not bitwise the same, and a fifth of the gradient reductions."""
    art = _build(tmp_path, "--pp", "2", *layout, "--pp-schedule", "zbv", "--microbatches", "5")
    runs = {}
    for name, options in (("default", ()), ("reduced", ("--pp-reduce-per-step",))):
        metrics = tmp_path / f"{name}.jsonl"
        r = titan("run", art, "--steps", 10, "--metrics", metrics, *options)
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = [(rec["loss"], rec["grad_norm"]) for rec in read_metrics(metrics)]
    assert len(runs["default"]) == len(runs["reduced"]) == 10
    for (loss, norm), (loss_r, norm_r) in zip(runs["default"], runs["reduced"]):
        assert abs(loss - loss_r) <= 1e-6 * loss and abs(norm - norm_r) <= 1e-5 * norm
    assert runs["default"] != runs["reduced"]  # the other summation order shows in the last bits
    shown = titan("show", art, "--graph", "fw")
    stages = [line for line in shown.stdout.splitlines() if re.match(r"  stage \d+: ", line)]
    assert stages, shown.stdout
    for line in stages:
        default, _, reduced = (dict((kind, int(n)) for n, kind in re.findall(r"(\d+) ([a-z-]+?)s?[ ,]", part))
                               for part in line.split("; "))
        # Per step, the collectives each micro-batch keeps (tp's) t, the gradient reductions d:
        # 5 t + 5 d by default, 5 t + d reduced once.
        for kind in ("reduce-scatter", "all-reduce"):
            d, rest = divmod(default.get(kind, 0) - reduced.get(kind, 0), 4)
            t, rest_t = divmod(reduced.get(kind, 0) - d, 5)
            assert rest == rest_t == 0 and t >= 0, (kind, line)
            assert (d > 0) == (kind == "reduce-scatter" or "--dp-replicate" in layout), (kind, line)
            if "--tp" not in layout:
                assert t == 0, (kind, line)
            elif kind == "reduce-scatter":
                assert t > 0, (kind, line)


@pytest.mark.slow
def test_a_checkpointed_pipeline_resumes_bitwise_and_exports_every_stage(pp2, tmp_path):
    art = pp2
    ckpt = assert_resumes_bitwise(art, tmp_path)
    r = titan("export", ckpt, "--hf", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    names = load_file(tmp_path / "hf" / "model.safetensors").keys()
    # Both stages' layers, the first's embedding and the last's norm and output: one checkpoint.
    assert {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)} <= names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names


def test_what_a_pipeline_run_cannot_do_yet_is_one_line(pp2):
    r = titan("run", pp2, "--steps", 1, "--accumulation-steps", 2)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: this pipeline artifact's step is its 3 micro-batches of 2 sequences per data-parallel rank (6 sequences); "
        "drop --accumulation-steps / --global-batch-size, or rebuild with titan-build --microbatches"]

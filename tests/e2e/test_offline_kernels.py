"""titan-build --kernels --gpu NAME: kernel plans built without a GPU (builder/export/offline_kernels.py).

Runs only where the CUDA build of torch and its triton are installed (the build host of issue
30; the CI's CPU torch refuses, tests/e2e/test_bad_input.py). That the plans equal those built
on the GPU and run bitwise equal to eager is checked there: benchmarks/gpu/gpu_offline_kernels.sh
(a pipeline artifact's: benchmarks/gpu/gpu_pipeline.sh, case pp2-kernels).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import titan

from titan.builder.export.gpu_target import TARGETS, toolchain_problem

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(toolchain_problem(TARGETS["h100"]) is not None,
                                 reason="needs the CUDA build of torch and its triton")]


def _kernels(art) -> dict[str, bytes]:
    manifest = json.loads((art / "manifest.json").read_text())
    return {key: (art / rel).read_bytes() for key, rel in manifest.get("kernels", {}).items()}


def test_every_exact_region_becomes_a_checked_plan_and_two_builds_make_the_same_bytes(tmp_path):
    from titan.runtime.kernels.kernel_plan import decode_plan

    arts = []
    for name in ("one", "two"):  # two users: separate build caches and private compiler caches
        env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / f"cache-{name}"),
                   TITAN_KEY_FILE=str(tmp_path / f"key-{name}" / "cache.key"))
        art = tmp_path / f"art-{name}"
        r = titan("build", "--flavor", "debug", "--dtype", "bf16", "--kernels", "--gpu", "h100", "--out", art, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("kernels: "))
        assert "built without a GPU for NVIDIA H100 80GB HBM3 sm90" in line and "left to compile" not in line, line
        assert r.stderr.strip() == "", r.stderr  # nothing but titan's lines
        arts.append(art)
    one, two = map(_kernels, arts)
    assert one and one == two  # line info off: no user's cache path in any cubin
    for data in one.values():
        plan = decode_plan(data)
        assert plan.launches and all(k.cubin.startswith(b"\x7fELF") for k in plan.kernels)


def test_a_build_without_the_flag_gets_no_kernels_from_an_earlier_kernels_build_of_its_key(tmp_path):
    """The cache entry records the kernels of a --kernels build; the same build without the flag
    (a cache hit) still writes an artifact without them: the default flow compiles on the GPU."""
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"), TITAN_KEY_FILE=str(tmp_path / "key" / "cache.key"))
    with_kernels, without = tmp_path / "with", tmp_path / "without"
    r = titan("build", "--flavor", "debug", "--dtype", "bf16", "--kernels", "--gpu", "h100", "--out", with_kernels,
              env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = titan("build", "--flavor", "debug", "--dtype", "bf16", "--out", without, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cache: hit" in r.stdout, r.stdout
    assert _kernels(with_kernels) and _kernels(without) == {}
    assert not (without / "kernels").exists()


@pytest.mark.parametrize("model,eos", [("llama3", 2047), ("deepseek_v3", 511)])
def test_flex_builds_carry_the_fused_attention_kernels_as_plans(model, eos, tmp_path):
    """A flex document build: FlexAttention's forward template and its backward (the row
    reduction and the template) planned beside the exact regions, keyed as the GPU run keys them;
    for DeepSeek-V3's latent attention at its head sizes (q and k 24, v 16: neither the same nor
    powers of two)."""
    from titan.runtime.kernels.kernel_plan import decode_plan

    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"), TITAN_KEY_FILE=str(tmp_path / "key" / "cache.key"))
    art = tmp_path / "art"
    r = titan("build", "--model", model, "--flavor", "debug", "--dtype", "bf16", "--seq-len", "256", "--attention",
              "flex", "--mask", "document", "--eos-id", eos, "--kernels", "--gpu", "h100", "--out", art, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("kernels: "))
    assert "left to compile" not in line, line
    names = sorted(k.name for data in _kernels(art).values() for k in decode_plan(data).kernels
                   if "flex_attention" in k.name)
    assert [n.split("_")[1] for n in names] == ["per", "tem", "tem"], names  # reduction, backward and forward templates


def test_a_pipeline_artifact_carries_the_kernels_every_stage_loads_on_every_rank(tmp_path):
    """pp 5 x tp 2 over 5 one-block stages: stage 2's programs are stage 1's relabeled (traced
    by no rank), and tp binds rank-specific values; every region each rank's stages load on the
    GPU (keyed as the run keys them, from the graphs bound to that rank) is a plan in the artifact."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan.runtime.contract.artifact import open_artifact
    from titan.runtime.kernels.fusion import compiled_here, region_kernels
    from titan.runtime.kernels.kernel_plan import decode_plan
    from titan.runtime.rank_graphs import load_rank_graphs
    from titan.runtime.stage_gather import gather_once

    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"), TITAN_KEY_FILE=str(tmp_path / "key" / "cache.key"))
    out = tmp_path / "art"
    r = titan("build", "--flavor", "debug", "--dtype", "bf16", "--n-layers", "5", "--pp", "5", "--tp", "2",
              "--microbatches", "5", "--kernels", "--gpu", "h100", "--out", out, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stage 2 relabeled from stage 1" in r.stdout, r.stdout
    stage_lines = [x for x in r.stdout.splitlines() if x.startswith("  stage ")]
    assert len(stage_lines) == 5 and all("left to compile" not in x for x in stage_lines), stage_lines
    art = open_artifact(out, check_torch=False)
    carried = set(art.manifest.kernels)
    device = torch.device("cuda", 0)
    groups = {dim: f"group-{dim}" for dim, _ in art.layout.mesh_shape()}
    for rank in range(art.world_size):
        for stage in art.manifest.stages_of(rank):
            with FakeTensorMode(allow_non_fake_inputs=True):
                stored = load_rank_graphs(art, rank, device=device, groups=groups, stage=stage)
                # As titan-run runs them by default: what the parameters alone determine, once per step.
                cut = gather_once(*load_rank_graphs(art, rank, device=device, groups=groups, stage=stage),
                                  n_params=len(art.rank_record(rank, stage=stage).params))
            for graphs in (stored, (cut.forward, cut.backward)):
                loaded = {key for gm in graphs
                          for key, (kind, _, _) in region_kernels(gm, device=TARGETS["h100"].tag).items()
                          if compiled_here(kind, device)}
                assert loaded and loaded <= carried, (rank, stage, len(loaded - carried))
    assert all(decode_plan(data).launches for data in _kernels(out).values())

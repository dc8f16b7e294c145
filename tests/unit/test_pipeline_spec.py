"""What titan-build accepts with --pp (builder/spec/pipeline_spec.py), in process: the layouts a
pipeline cannot have are one error each with the fix, a build without --pp keeps its cache key
and name, and a pipeline's choices are in its key and name. (The command: e2e/test_pipeline_build.py.)"""

from __future__ import annotations

import pytest

from titan.builder.spec.build_spec import make_spec
from titan.builder.spec.cache_key import build_factors, digest

DEBUG = dict(model="llama3", flavor="debug", tp=1, dp_shard=1, dp_replicate=1, batch_size=None, seq_len=None)
FOUR_LAYERS = DEBUG | dict(shape={"n_layers": 4})


@pytest.mark.parametrize("change, message", [
    (dict(pp=3), "--pp 3 needs at least 3 layers (one per stage); the model has 2: use fewer stages or more "
                 "--n-layers"),
    (dict(pp=2, pp_schedule="interleaved-1f1b"), "--pp 2 x --pp-stages-per-rank 2 needs at least 4 layers (one per "
                                                 "stage); the model has 2: use fewer stages or more --n-layers"),
    (dict(pp=2, pp_stages_per_rank=2), "--pp-stages-per-rank 2 needs --pp-schedule interleaved-1f1b; add it or drop "
                                       "--pp-stages-per-rank"),
    (dict(pp=2, pp_schedule="interleaved-1f1b", pp_stages_per_rank=1),
     "--pp-schedule interleaved-1f1b needs --pp-stages-per-rank >= 2; raise it or use 1f1b"),
    (dict(pp=2, pp_schedule="interleaved-1f1b", microbatches=5, shape={"n_layers": 4}),
     "--pp-schedule interleaved-1f1b runs micro-batches in rounds of about --pp: --microbatches 5 is not a multiple "
     "of its 2 rounds; use a multiple of --pp"),
    (dict(pp=2, model="qwen3"), "--pp 2: this qwen3 flavor ties its output projection to the embedding, one "
                                "weight the first and the last stage would share, whose gradients would have to be "
                                "summed across the two stages (not built); use an untied flavor (8B, 14B, 32B, "
                                "debug-moe, 30B-A3B, 235B-A22B) or --pp 1"),
    (dict(pp=2, microbatches=1), "--pp-schedule 1f1b needs --microbatches >= --pp (1 < 2): its warm-up fills every "
                                 "stage; raise --microbatches or use --pp-schedule gpipe"),
    (dict(pp=2, pp_schedule="zb-h1"), "unknown --pp-schedule 'zb-h1'; use one of gpipe, 1f1b, interleaved-1f1b, zbv"),
    (dict(pp=2, pp_schedule="zbv"), "--pp 2 x --pp-stages-per-rank 2 needs at least 4 layers (one per stage); the "
                                    "model has 2: use fewer stages or more --n-layers"),
    (dict(pp=2, pp_schedule="zbv", pp_stages_per_rank=3, shape={"n_layers": 6}),
     "--pp-schedule zbv places exactly 2 stages on each rank (rank r holds stages r and 2 pp - 1 - r, a V), not 3; "
     "drop --pp-stages-per-rank or use interleaved-1f1b"),
    (dict(pp=2, pp_split="1,3"), "--pp-split '1,3' holds 4 layers; the model has 2"),
    (dict(pp=64, microbatches=4096, shape={"n_layers": 64}),
     "64 stages x --microbatches 4096 is up to 1,572,864 actions per step, more than a schedule record holds "
     "(1,048,576); use fewer micro-batches"),
    (dict(microbatches=4), "--microbatches set without --pp; add --pp N (N > 1) or drop --microbatches"),
    (dict(pp_split="1,1"), "--pp-split set without --pp; add --pp N (N > 1) or drop --pp-split"),
])
def test_a_pipeline_that_cannot_be_built_is_one_error_with_the_fix(change, message):
    with pytest.raises(ValueError) as e:
        make_spec(**(DEBUG | change))
    assert str(e.value) == message


def test_a_build_without_pp_keeps_its_key_and_name():
    spec = make_spec(**(DEBUG | dict(tp=2)))
    assert spec.pipeline is None and spec.name == "llama3-debug-tp2"
    assert "pipeline" not in build_factors(spec) and build_factors(spec)["mesh"] == [["tp", 2]]
    assert spec.layout.as_dict() == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "ep": 1, "tp": 2}


def test_a_pipelines_schedule_micro_batches_and_split_are_in_its_key_and_name():
    spec = make_spec(**(FOUR_LAYERS | dict(pp=2, tp=2, dp_shard=2, microbatches=4)))
    assert spec.layout.world_size == 8 and spec.layout.dp_degree == 2
    assert spec.name == "llama3-debug-n_layers4-pp2-dp-shard2-tp2-1f1b-mb4"
    assert spec.pipeline.stage_layers == (2, 2) and not spec.pipeline.split_given
    factors = build_factors(spec)
    assert factors["mesh"] == [["pp", 2], ["dp_shard", 2], ["tp", 2]]
    assert factors["pipeline"] == {"schedule": "1f1b", "microbatches": 4, "stage layers": [2, 2]}
    keys = {digest(build_factors(make_spec(**(FOUR_LAYERS | dict(pp=2, tp=2, dp_shard=2) | change))))
            for change in ({}, dict(microbatches=4), dict(pp_schedule="gpipe"), dict(pp_split="3,1"))}
    assert len(keys) == 4
    given = make_spec(**(FOUR_LAYERS | dict(pp=2, pp_split="3,1", pp_schedule="gpipe", microbatches=3)))
    assert given.name.endswith("-pp2-gpipe-mb3-split-3-1") and given.pipeline.schedule_record().in_flight(0) == 3
    interleaved = make_spec(**(FOUR_LAYERS | dict(pp=2, pp_schedule="interleaved-1f1b")))
    assert interleaved.name.endswith("-pp2-interleaved-1f1b-v2-mb2") and interleaved.pipeline.stage_layers == (1,) * 4
    zbv = make_spec(**(FOUR_LAYERS | dict(pp=2, pp_schedule="zbv", microbatches=3)))
    assert zbv.name.endswith("-pp2-zbv-mb3") and zbv.pipeline.stage_layers == (1,) * 4
    assert zbv.pipeline.schedule_record().stage_rank == (0, 1, 1, 0)
    assert build_factors(zbv)["pipeline"] != build_factors(interleaved)["pipeline"]
    assert build_factors(interleaved)["pipeline"]["stages per rank"] == 2
    assert interleaved.pipeline.schedule_record().stage_rank == (0, 1, 0, 1)


def test_a_deepseek_pipeline_splits_dense_then_moe_blocks_by_what_a_token_runs_through():
    spec = make_spec(**(DEBUG | dict(model="deepseek_v3", pp=2, ep=2)))
    assert spec.pipeline.stage_layers == (2, 1) and spec.name == "deepseek_v3-debug-pp2-ep2-1f1b-mb2"
    from titan.builder.models.deepseek_v3.config import FLAVORS
    from titan.builder.models.deepseek_v3.stage_costs import stage_costs
    cfg = FLAVORS["671B"]
    costs = stage_costs(cfg, 4096)
    # A MoE block costs its top 8 routed experts and its shared one, not its 256: as much as a dense
    # block (18432 = 9 x 2048 hidden), plus the router.
    assert costs.block[3] - costs.block[2] == 6 * cfg.n_routed_experts * cfg.dim
    # Its parameters count every expert, and which of them are routed (split over ep, not tp).
    assert costs.block_params[3] - costs.block_expert_params[3] == cfg.attention_params + cfg.feed_forward_params(
        moe=True, experts=0)
    assert sum(costs.block_params) + costs.embedding_params + costs.head_params == cfg.n_params


def test_a_drop_and_pad_pipeline_builds_every_stage_bounded_and_says_so_in_its_name():
    spec = make_spec(**(DEBUG | dict(model="deepseek_v3", pp=2, ep=2, microbatches=3, moe_capacity=0.5,
                                     moe_drop=True)))
    assert spec.name.endswith("-cap0.5-drop") and not spec.moe_redo
    stages = spec.stage_builds()
    assert [(s.moe_capacity, s.moe_drop) for s in stages] == [(0.5, True)] * 2
    dropless = make_spec(**(DEBUG | dict(model="deepseek_v3", pp=2, ep=2, microbatches=3))).stage_builds()
    assert {digest(build_factors(s)) for s in stages}.isdisjoint(digest(build_factors(s)) for s in dropless)


def test_a_bounded_pipeline_that_stays_dropless_redoes_with_the_dropless_pipelines_own_stages():
    bounded = make_spec(**(DEBUG | dict(model="deepseek_v3", pp=2, ep=2, microbatches=3, moe_capacity=1.25)))
    assert bounded.moe_redo and bounded.name.endswith("-cap1.25")
    plain = make_spec(**(DEBUG | dict(model="deepseek_v3", pp=2, ep=2, microbatches=3)))
    # The redo programs are the dropless pipeline's stages: the same cache entries, traced once.
    assert ([digest(build_factors(s)) for s in bounded.dropless().stage_builds()]
            == [digest(build_factors(s)) for s in plain.stage_builds()])
    assert all(s.moe_capacity == 1.25 and not s.moe_drop for s in bounded.stage_builds())

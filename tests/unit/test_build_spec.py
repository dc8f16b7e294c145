"""What titan-build accepts (builder/build.py make_spec, builder/spec/layout.py), in process: every
model, flavor, layout and option it cannot build is one ValueError that says how to fix it,
and the artifact's default name spells out each choice that differs from its default. (The
same through the command line: e2e/test_bad_input.py, e2e/test_options.py.)"""

from __future__ import annotations

import pytest

from titan.builder.spec.build_spec import make_spec, non_default_choices

DEBUG = dict(model="llama3", flavor="debug", tp=1, dp_shard=1, dp_replicate=1, batch_size=None, seq_len=None)


@pytest.mark.parametrize("change, message", [
    (dict(model="gpt9"), "unknown model 'gpt9'; available: llama3, deepseek_v3, qwen3"),
    (dict(flavor="13B"), "unknown flavor '13B' for llama3; available: debug, 1B, 8B, 70B, 405B"),
    (dict(tp=3), "--tp 3 does not divide the attention heads (8); pick a --tp that divides it"),
    (dict(dp_shard=0), "--dp-shard must be >= 1, got 0"),
    (dict(ep=2), "--ep 2: llama3 has no routed experts to split; drop --ep (or build a mixture-of-experts model such "
                 "as --model deepseek_v3)"),
    (dict(model="deepseek_v3", ep=3), "--ep 3 does not divide the routed experts (8); pick a --ep that divides it"),
    (dict(tp=2, seq_len=127), "--seq-len 127 must be divisible by --tp 2 (sequence parallel shards it)"),
    (dict(seq_len=1), "--batch-size must be >= 1 and --seq-len >= 2"),
    (dict(batch_size=10**12), "--batch-size 1000000000000 x --seq-len 128 is 128,000,000,000,000 tokens per rank, "
                              "more than 4,194,304; use a smaller batch or more data-parallel ranks"),
    (dict(dtype="fp16"), "unknown --dtype 'fp16'; use bf16 or fp32"),
    (dict(ac="most"), "unknown --ac 'most'; use one of none, full, selective"),
    (dict(partitioner="best"), "unknown partitioner 'best'; available: min_cut, default"),
    (dict(fuse="all"), "--fuse 'all': use regions or blocks"),
    (dict(passes=("nope",)), "unknown pass 'nope'; titan-build --list-passes shows them"),
    (dict(passes=("fuse_exact", "mask_index_put_to_where")),
     "--passes: fuse_exact must come last (it groups the graph's final order into kernels)"),
    (dict(tp=2, passes=("bucket_all_gather",)), "pass bucket_all_gather needs --dp-shard > 1 in the layout; drop it "
                                                "from --passes"),
    (dict(pp=2, passes=("fold_param_casts",)), "pass fold_param_casts does not apply with --pp > 1; drop it from "
                                               "--passes"),
    (dict(model="deepseek_v3", tp=2, ep=2, etp=4), "--etp 4: expert tensor parallel splits each routed expert over "
     "the --tp ranks, so it is 1 or the --tp degree (2); use --etp 1 or --etp 2"),
    (dict(model="deepseek_v3", ep=2, etp=2), "--etp 2: expert tensor parallel splits each routed expert over the --tp "
     "ranks, and this layout has none; add --tp 2 or drop --etp"),
    (dict(model="deepseek_v3", tp=2, etp=2, shape={"moe_hidden": 33}),
     "--etp 2 does not divide the routed expert hidden width (33); pick a --etp that divides it"),
    (dict(tp=2, etp=2), "--etp 2: this llama3 flavor has no routed experts to split; drop --etp or build a "
                        "mixture-of-experts flavor"),
    (dict(model="qwen3", tp=2, etp=2), "--etp 2: this qwen3 flavor has no routed experts to split; drop --etp or "
                                       "build a mixture-of-experts flavor"),
    (dict(model="deepseek_v3", etp=0), "--etp 0: the degree must be >= 1"),
    (dict(model="deepseek_v3", tp=2, shape={"etp": 2}), "--shape etp: expert tensor parallelism is chosen with "
                                                        "--etp, not as a dimension"),
    (dict(moe_drop=True, model="deepseek_v3"), "--moe-drop drops the assignments past a capacity: give the capacity "
                                               "too, e.g. --moe-capacity 1.25 --moe-drop"),
    (dict(moe_capacity=1.25), "--moe-capacity: this llama3 flavor has no routed experts to dispatch; drop "
                              "--moe-capacity or build a mixture-of-experts flavor"),
    (dict(model="qwen3", moe_capacity=1.25), "--moe-capacity: this qwen3 flavor has no routed experts to dispatch; "
                                             "drop --moe-capacity or build a mixture-of-experts flavor"),
    (dict(model="deepseek_v3", moe_capacity=0.0), "--moe-capacity 0.0: the capacity factor must be a positive number, "
                                                  "e.g. 1.25"),
    (dict(model="deepseek_v3", moe_capacity=float("inf")), "--moe-capacity inf: the capacity factor must be a positive "
                                                           "number, e.g. 1.25"),
])
def test_what_cannot_be_built_is_one_error_with_the_fix(change, message):
    with pytest.raises(ValueError) as e:
        make_spec(**(DEBUG | change))
    assert str(e.value) == message


def test_the_parameters_casts_leave_the_forward_by_default_except_in_pipeline_stages():
    # A pipeline stage's runtime takes its parameters as they are (runtime/pipeline_stage.py).
    assert "fold_param_casts" in make_spec(**(DEBUG | dict(tp=2))).graph_passes
    assert "fold_param_casts" not in make_spec(**(DEBUG | dict(pp=2))).graph_passes


def test_layouts_that_pad_or_nest_are_accepted():
    # dp_shard 3 divides no row count of the debug model: FSDP pads (runtime/contract/shards.py).
    assert make_spec(**(DEBUG | dict(dp_shard=3))).layout.world_size == 3
    spec = make_spec(**(DEBUG | dict(model="deepseek_v3", dp_replicate=2, dp_shard=2, ep=2, tp=2)))
    assert spec.layout.world_size == 16 and spec.layout.dp_degree == 8


@pytest.mark.parametrize("change, tags", [
    ({}, []),
    (dict(tp=2), []),
    (dict(seq_len=64), ["s64"]),
    (dict(batch_size=4, seq_len=256, dtype="bf16", ac="full"), ["b4", "s256", "bf16", "ac-full"]),
    (dict(partitioner="default"), ["default-partition"]),
    (dict(fuse="blocks"), ["fuse-blocks"]),
    (dict(passes=("mask_index_put_to_where",)), ["passes-993a2573"]),
])
def test_an_artifact_name_spells_out_each_choice_that_is_not_the_default(change, tags):
    spec = make_spec(**(DEBUG | change))
    assert non_default_choices(flavor=spec.flavor, mesh=[list(d) for d in spec.layout.mesh_shape()],
                               batch_size=spec.batch_size, seq_len=spec.seq_len, dtype=spec.dtype, ac=spec.ac,
                               passes=spec.passes) == tags


@pytest.mark.parametrize("change, suffix", [
    (dict(model="deepseek_v3", ep=2, moe_capacity=1.25), "deepseek_v3-debug-ep2-cap1.25"),
    (dict(model="deepseek_v3", ep=2, moe_capacity=1.25, moe_drop=True), "deepseek_v3-debug-ep2-cap1.25-drop"),
    (dict(model="qwen3", flavor="debug-moe", ep=2, moe_capacity=2.0), "qwen3-debug-moe-ep2-cap2"),
    (dict(model="deepseek_v3", ep=2), "deepseek_v3-debug-ep2"),
])
def test_a_moe_capacity_is_in_the_name_and_its_redo_build_is_the_default(change, suffix):
    spec = make_spec(**(DEBUG | change))
    assert spec.name == suffix
    assert spec.moe_redo == (spec.moe_capacity is not None and not spec.moe_drop)
    assert spec.dropless() == make_spec(**(DEBUG | {k: v for k, v in change.items() if not k.startswith("moe_")}))


def test_expert_tp_is_in_the_model_config_the_cache_key_and_the_name():
    """--etp is the config's `etp` (so the eager reference of titan-verify builds the same model
    from the manifest); at 1 it is left out, so builds without it keep their keys and names."""
    from titan.builder.spec.cache_key import build_factors, digest

    base = DEBUG | dict(model="deepseek_v3", tp=2, ep=2)
    whole, split = make_spec(**base), make_spec(**(base | dict(etp=2)))
    assert "etp" not in whole.cfg.as_dict() and split.cfg.as_dict()["etp"] == 2
    assert (whole.name, split.name) == ("deepseek_v3-debug-ep2-tp2", "deepseek_v3-debug-ep2-tp2-etp2")
    assert digest(build_factors(whole)) != digest(build_factors(split))
    assert make_spec(**(base | dict(etp=1))) == whole
    assert split.dropless().etp == 2
    assert make_spec(**(DEBUG | dict(model="qwen3", flavor="debug-moe", tp=2, etp=2))).name == "qwen3-debug-moe-tp2-etp2"

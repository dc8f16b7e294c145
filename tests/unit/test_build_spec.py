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

"""Graph passes recorded in the artifact do their one job (numerics: test_layouts_bitwise)."""

from __future__ import annotations

import pytest

from conftest import titan
from titan.runtime.contract.artifact import open_artifact


def test_vocab_parallel_embedding_mask_uses_where_not_index_put(debug_artifact):
    art = debug_artifact(tp=2)
    assert open_artifact(art).manifest.passes == ("partition:min_cut", "mask_index_put_to_where", "fold_param_casts",
                                                  "overlap_collectives", "fuse_exact")
    out = titan("show", art, "--rank", 1).stdout
    # A boolean-mask index_put syncs with the host (nonzero), which CUDA graph capture refuses.
    assert "aten.index_put" not in out
    wheres = [line for line in out.splitlines() if "aten.where.self" in line]
    assert len(wheres) == 2 and all(line.endswith("[tok_embeddings]") for line in wheres)


@pytest.mark.slow
def test_passes_are_listed_chosen_by_name_and_part_of_the_build(debug_artifact, tmp_path):
    listing = titan("build", "--list-passes")
    assert listing.returncode == 0
    assert listing.stdout.startswith("mask_index_put_to_where [numerics-preserving, default]: ")
    bad = titan("build", "--flavor", "debug", "--passes", "mask_index_put_to_where,nope", "--out", tmp_path / "x")
    assert bad.returncode == 2 and "unknown pass 'nope'" in bad.stderr and not (tmp_path / "x").exists()
    bare = debug_artifact(tp=2, extra=("--passes", ""))
    assert open_artifact(bare).manifest.passes == ("partition:min_cut",)
    assert "aten.index_put" in titan("show", bare, "--graph", "fw").stdout
    # Without the pass the artifact still trains exactly like eager on CPU (no CUDA graphs here).
    r = titan("verify", bare, "--steps", 2)
    assert r.returncode == 0 and "bitwise equal: yes" in r.stdout
    diff = titan("diff", debug_artifact(tp=2), bare, "--rank", 0, "--graph", "fw")
    assert diff.returncode == 1 and "mask_index_put_to_where" in diff.stdout


def _collective_counts(art, kind: str) -> int:
    out = titan("show", art, "--graph", kind).stdout.splitlines()
    return int(next(line for line in out if line.endswith("collectives (marked **)")).split()[0])


def _lines(art, kind: str) -> list[str]:
    return titan("show", art, "--graph", kind).stdout.splitlines()


def test_fsdp_collectives_are_bucketed_per_block_and_recorded_in_the_plan(debug_artifact):
    unbucketed = debug_artifact(dp_shard=2, extra=("--passes", "mask_index_put_to_where"))
    bucketed = debug_artifact(dp_shard=2)
    art = open_artifact(bucketed)
    assert list(art.manifest.passes) == ["partition:min_cut", "mask_index_put_to_where", "bucket_all_gather",
                                  "bucket_reduce_scatter", "fold_param_casts", "overlap_collectives", "fuse_exact"]
    # 21 parameters: one all-gather each in forward and one reduce-scatter each in backward,
    # merged into one per block (tok_embeddings, layers.0, layers.1, norm, output).
    assert (_collective_counts(unbucketed, "fw"), _collective_counts(unbucketed, "bw")) == (21, 21)
    assert (_collective_counts(bucketed, "fw"), _collective_counts(bucketed, "bw")) == (5, 5)
    plan = [(b.graph, b.kind, b.group, b.block, len(b.params), b.elements) for b in art.rank_record(0).bucket_plan]
    block = (2 * 256 + 2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 704) // 2  # this rank's half of one block
    assert plan == [("forward", "all_gather", "dp_shard", "tok_embeddings", 1, 1024 * 256),
                    ("forward", "all_gather", "dp_shard", "layers.0", 9, block),
                    ("forward", "all_gather", "dp_shard", "layers.1", 9, block),
                    ("forward", "all_gather", "dp_shard", "norm", 1, 128),
                    ("forward", "all_gather", "dp_shard", "output", 1, 1024 * 256),
                    ("backward", "reduce_scatter", "dp_shard", "output", 1, 1024 * 256),
                    ("backward", "reduce_scatter", "dp_shard", "norm", 1, 128),
                    ("backward", "reduce_scatter", "dp_shard", "layers.1", 9, block),
                    ("backward", "reduce_scatter", "dp_shard", "layers.0", 9, block),
                    ("backward", "reduce_scatter", "dp_shard", "tok_embeddings", 1, 1024 * 256)]
    assert "bucket plan (forward): 5 buckets" in _lines(bucketed, "fw")


def test_fsdp_all_gathers_are_prefetched_one_block_ahead(debug_artifact):
    fw = _lines(debug_artifact(dp_shard=2), "fw")
    events = []
    for line in fw:
        if "all_gather_into_tensor" in line:
            events.append(("start", line.rsplit("[", 1)[1].rstrip("]")))
        elif "wait_tensor" in line:
            events.append(("wait", line.rsplit("[", 1)[1].rstrip("]")))
    blocks = [m for kind, m in events if kind == "start"]
    assert blocks == ["tok_embeddings", "layers.0.attention_norm", "layers.1.attention_norm", "norm", "output"]
    # Each block's gather is issued right after the previous block's wait, before that block computes.
    assert events == [("start", blocks[0])] + [e for i in range(1, 5) for e in (("wait", blocks[i - 1]),
                                                                                ("start", blocks[i]))] + [
        ("wait", blocks[4])]
    first_mm = next(i for i, line in enumerate(fw) if "aten.mm.default" in line and "[layers.0" in line)
    second_start = next(i for i, line in enumerate(fw) if "all_gather_into_tensor" in line and "[layers.1" in line)
    assert second_start < first_mm


def test_tp_reduce_scatter_overlaps_with_the_weight_gradient_matmuls(debug_artifact):
    bw = _lines(debug_artifact(tp=2), "bw")
    start = next(i for i, line in enumerate(bw) if "reduce_scatter_tensor" in line and "[layers.1.feed_forward]" in line)
    name = bw[start].split()[0].lstrip("*")
    wait = next(i for i, line in enumerate(bw) if f"wait_tensor.default({name})" in line)
    between = [line for line in bw[start:wait] if "aten.mm.default" in line]
    # The weight gradients of w1, w2 and w3 do not need the reduced input gradient.
    assert sorted(line.rsplit("[", 1)[1] for line in between) == ["layers.1.feed_forward.w1]",
                                                                  "layers.1.feed_forward.w2]",
                                                                  "layers.1.feed_forward.w3]"]


def test_a_pass_that_cannot_apply_to_the_layout_fails_the_build(tmp_path):
    r = titan("build", "--flavor", "debug", "--tp", 2, "--passes", "bucket_all_gather", "--out", tmp_path / "x")
    assert r.returncode == 2 and not (tmp_path / "x").exists()
    assert r.stderr.strip() == "error: pass bucket_all_gather needs --dp-shard > 1 in the layout; drop it from --passes"


def test_full_activation_checkpointing_recomputes_blocks_and_stays_bitwise(debug_artifact):
    plain, full = debug_artifact(dp_shard=2), debug_artifact(dp_shard=2, extra=("--ac", "full"))
    meta = {name: open_artifact(art).rank_record(0) for name, art in (("none", plain), ("full", full))}
    assert open_artifact(full).manifest.ac == "full"
    # Only the residual stream between blocks (and what no block owns) stays saved ...
    assert 2 * meta["full"].saved_activations <= meta["none"].saved_activations
    assert 2 * meta["full"].saved_bytes <= meta["none"].saved_bytes
    # ... and the backward gathers each block's parameters again (reshard after forward).
    regathered = [b.block for b in meta["full"].bucket_plan if b.graph == "backward" and b.kind == "all_gather"]
    assert regathered == ["layers.1", "layers.0"]
    r = titan("verify", full, "--steps", 3)
    assert r.returncode == 0 and "bitwise equal: yes" in r.stdout, r.stdout + r.stderr

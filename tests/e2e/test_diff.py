"""titan-diff / titan-show on real debug artifacts."""

from __future__ import annotations

import json

import pytest

from conftest import titan


def _diff_json(*args) -> tuple[int, dict]:
    r = titan("diff", *args, "--json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def _by(report: dict, where: str) -> list[dict]:
    return [d for d in report["differences"] if d["where"] == where]


def test_tp_ranks_differ_exactly_in_the_values_they_bind(debug_artifact):
    code, report = _diff_json(debug_artifact(tp=2), "--ranks", 0, 1)
    assert code == 1 and not report["identical"]
    # One program serves both ranks; what differs is what each binds from its coordinates.
    assert report["same_blobs"] == {"forward": True, "backward": True}
    # Forward: the vocab-parallel embedding masks ids outside this rank's vocab shard
    # [start, start + 1024) and shifts ids by start.
    fw = {(d["module"], d["node"].split()[1].rstrip("_0123456789"), d["detail"]) for d in _by(report, "forward")}
    assert fw == {("tok_embeddings", "lt", "arg 1: binds 0 -> 1024"),
                  ("tok_embeddings", "ge", "arg 1: binds 1024 -> 2048"),
                  ("tok_embeddings", "sub", "arg 1: binds 0 -> 1024")}
    # Backward: the rank's slice of the gathered output-layer input and of the embedding output.
    bw = {(d["module"], d["category"], d["detail"]) for d in _by(report, "backward")}
    assert bw == {("output", "bindings", "arg 1: binds 0 -> 1"), ("tok_embeddings", "bindings", "arg 1: binds 0 -> 1")}
    # Rank metadata: the rank, its tp coordinate and which tp slice each sharded parameter holds
    # (12 split on dim 0: embedding, output, wq/wk/wv/w1/w3; 4 on dim 1: wo/w2), one line per change.
    rank = [d["detail"] for d in _by(report, "rank")]
    assert rank == ["coords.tp: 0 -> 1", "rank: 0 -> 1",
                    "params slices: [[0, 2, 0]] -> [[0, 2, 1]] for layers.0.attention.wk.weight, "
                    "layers.0.attention.wq.weight, layers.0.attention.wv.weight, ... (12 params)",
                    "params slices: [[1, 2, 0]] -> [[1, 2, 1]] for layers.0.attention.wo.weight, "
                    "layers.0.feed_forward.w2.weight, layers.1.attention.wo.weight, ... (4 params)"]
    assert not _by(report, "manifest")


def test_fsdp_ranks_share_graphs_and_differ_only_in_shard_coordinates(debug_artifact):
    code, report = _diff_json(debug_artifact(dp_shard=2), "--ranks", 0, 1)
    assert code == 1
    assert report["same_blobs"] == {"forward": True, "backward": True}
    assert not _by(report, "forward") and not _by(report, "backward")
    rank = [d["detail"] for d in _by(report, "rank")]
    assert rank[:2] == ["coords.dp_shard: 0 -> 1", "rank: 0 -> 1"] and len(rank) == 3
    assert rank[2].startswith("params slices: [[0, 2, 0]] -> [[0, 2, 1]] for ") and rank[2].endswith("(21 params)")


@pytest.mark.slow
def test_builds_with_different_passes_show_what_changed(debug_artifact):
    a = debug_artifact(dp_shard=2)
    b = debug_artifact(dp_shard=2, extra=("--partitioner", "default"))
    code, report = _diff_json(a, b, "--rank", 0)
    assert code == 1
    assert [d["detail"] for d in _by(report, "manifest")] == [
        "passes: -partition:min_cut +partition:default"]
    assert any(d["detail"].startswith("saved_activations: 57 -> ") for d in _by(report, "rank"))
    cats = {d["category"] for d in _by(report, "forward") + _by(report, "backward")}
    assert {"inserted", "removed"} <= cats and "collectives" not in cats


def test_collectives_between_layouts_are_reported_with_group(debug_artifact):
    code, report = _diff_json(debug_artifact(tp=2), debug_artifact(dp_shard=2), "--rank", 0, "--graph", "fw")
    assert code == 1
    coll = [d["detail"] for d in _by(report, "forward") if d["category"] == "collectives"]
    assert any("all_gather_into_tensor" in c and c.endswith("on tp") for c in coll)
    assert any("all_gather_into_tensor" in c and c.endswith("on dp_shard") for c in coll)
    assert "backward" not in report["same_blobs"]


def test_identical_builds_are_identical_with_exit_zero(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    again = tmp_path / "again"
    assert titan("build", "--flavor", "debug", "--tp", 2, "--out", again).returncode == 0
    r = titan("diff", art, again, "--rank", 1)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "identical"


def test_diff_usage_errors_exit_two(debug_artifact):
    art = debug_artifact(tp=2)
    assert titan("diff", art).returncode == 2
    assert titan("diff", art, "--ranks", 0, 7).returncode == 2


def test_show_lists_inputs_collectives_and_the_saved_boundary(debug_artifact):
    r = titan("show", debug_artifact(tp=2), "--rank", 1)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "forward graph of rank 1" in out and "backward graph of rank 1" in out
    assert "tok_embeddings.weight" in out and "tokens" in out and "labels" in out
    assert "saved for backward (57)" in out and "saved activation 56" in out
    marked = [line for line in out.splitlines() if line.startswith("**")]
    assert marked and all("_c10d_functional." in line and "group=tp" in line for line in marked)
    assert "gradients: tok_embeddings.weight=" in out


def test_builds_with_and_without_bucketing_show_the_buckets_and_collectives(debug_artifact):
    plain = debug_artifact(dp_shard=2, extra=("--passes", "mask_index_put_to_where"))
    code, report = _diff_json(plain, debug_artifact(dp_shard=2), "--rank", 0)
    assert code == 1
    plan = sorted(d["detail"].split(":")[0] for d in report["differences"] if d["category"] == "bucket plan")
    blocks = ("layers.0", "layers.1", "norm", "output", "tok_embeddings")
    assert plan == sorted([f"added forward all-gather bucket on dp_shard for {b}" for b in blocks]
                          + [f"added backward reduce-scatter bucket on dp_shard for {b}" for b in blocks])
    coll = [d for d in report["differences"] if d["category"] == "collectives"]
    assert {d["where"] for d in coll} == {"forward", "backward"}
    assert any("all_gather_into_tensor" in d["detail"] for d in coll if d["where"] == "forward")
    assert any("reduce_scatter_tensor" in d["detail"] for d in coll if d["where"] == "backward")

"""Graph passes recorded in the artifact do their one job (numerics: test_layouts_bitwise)."""

from __future__ import annotations

import json

from conftest import titan


def test_vocab_parallel_embedding_mask_uses_where_not_index_put(debug_artifact):
    art = debug_artifact(tp=2)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["passes"] == ["partition:min_cut", "mask_index_put_to_where"]
    out = titan("show", art, "--rank", 1).stdout
    # A boolean-mask index_put syncs with the host (nonzero), which CUDA graph capture refuses.
    assert "aten.index_put" not in out
    wheres = [line for line in out.splitlines() if "aten.where.self" in line]
    assert len(wheres) == 2 and all(line.endswith("[tok_embeddings]") for line in wheres)


def test_passes_are_listed_chosen_by_name_and_part_of_the_build(debug_artifact, tmp_path):
    listing = titan("build", "--list-passes")
    assert listing.returncode == 0
    assert listing.stdout.startswith("mask_index_put_to_where [numerics-preserving, default]: ")
    bad = titan("build", "--flavor", "debug", "--passes", "mask_index_put_to_where,nope", "--out", tmp_path / "x")
    assert bad.returncode == 2 and "unknown pass 'nope'" in bad.stderr and not (tmp_path / "x").exists()
    bare = debug_artifact(tp=2, extra=("--passes", ""))
    assert json.loads((bare / "manifest.json").read_text())["passes"] == ["partition:min_cut"]
    assert "aten.index_put" in titan("show", bare, "--graph", "fw").stdout
    # Without the pass the artifact still trains exactly like eager on CPU (no CUDA graphs here).
    r = titan("verify", bare, "--steps", 2)
    assert r.returncode == 0 and "bitwise equal: yes" in r.stdout
    diff = titan("diff", debug_artifact(tp=2), bare, "--rank", 0, "--graph", "fw")
    assert diff.returncode == 1 and "mask_index_put_to_where" in diff.stdout

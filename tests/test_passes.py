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

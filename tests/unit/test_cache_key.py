"""The cache key (builder/spec/cache_key.py): every factor that changes a build's output is named,
each graph-shaping choice changes the key, and --explain's lines name exactly the factor that
changed. (Hits and misses of real builds: e2e/test_cache.py.)"""

from __future__ import annotations

import pytest

from titan.builder.spec.build_spec import make_spec
from titan.builder.spec.cache_key import build_factors, describe_differences, digest, rank_factors

DEBUG = dict(model="llama3", flavor="debug", tp=1, dp_shard=1, dp_replicate=1, batch_size=None, seq_len=None)


def _factors(**changes) -> dict:
    return build_factors(make_spec(**(DEBUG | changes)))


def test_the_key_names_every_factor_that_changes_a_build():
    factors = _factors()
    assert sorted(factors) == ["activation checkpointing", "batch size", "builder version", "dtype", "flavor", "mesh",
                               "model", "model config", "passes", "seq len", "target device", "torch version"]
    assert (factors["mesh"], factors["batch size"], factors["seq len"], factors["dtype"]) == ([], 2, 128, "float32")
    assert factors["passes"] == ["partition:min_cut", "mask_index_put_to_where", "fold_param_casts",
                                 "overlap_collectives", "fuse_exact"]
    key = digest(factors)
    assert len(key) == 32 and int(key, 16) >= 0
    assert digest(dict(reversed(factors.items()))) == key == digest(_factors()), "the key depends on values only"


@pytest.mark.parametrize("change, explained", [
    (dict(seq_len=64), ["seq len 128 -> 64"]),
    (dict(batch_size=4), ["batch size 2 -> 4"]),
    (dict(tp=2), ['mesh [] -> [["tp", 2]]']),
    (dict(dtype="bf16"), ["dtype float32 -> bfloat16"]),
    (dict(ac="full"), ["activation checkpointing none -> full"]),
    (dict(partitioner="default"), ["passes +partition:default -partition:min_cut"]),
    (dict(passes=("mask_index_put_to_where",)), ["passes -fold_param_casts -overlap_collectives -fuse_exact"]),
    (dict(fuse="blocks"), ["passes +fuse_blocks -fuse_exact"]),
    (dict(flavor="1B", seq_len=128, batch_size=2, dtype="fp32"),
     ["flavor debug -> 1B", "model config dim 256 -> 2048", "model config ffn_dim_multiplier None -> 1.5",
      "model config multiple_of 64 -> 256", "model config n_heads 8 -> 32", "model config n_kv_heads 4 -> 8",
      "model config n_layers 2 -> 16", "model config vocab_size 2048 -> 128256"]),
])
def test_each_choice_changes_the_key_and_is_named_when_explained(change, explained):
    base, changed = _factors(), _factors(**change)
    assert digest(changed) != digest(base)
    assert describe_differences(base, changed) == explained
    assert describe_differences(base, base) == []


def test_a_rank_key_adds_its_coordinates_and_a_shallow_trace_its_depth():
    factors = _factors(tp=2)
    ranks = [rank_factors(factors, {"tp": r}) for r in range(2)]
    assert digest(ranks[0]) != digest(ranks[1]) and ranks[0]["rank coordinates"] == {"tp": 0}
    shallow = rank_factors(factors, {"tp": 0}, depth=3)
    assert shallow["traced depth"] == 3 and digest(shallow) != digest(ranks[0])
    assert describe_differences(ranks[0], shallow) == ["traced depth None -> 3"]


def test_a_moe_capacity_is_a_factor_only_when_set():
    """A dropless build keeps its key; a capacity (and drop-and-pad) each make another, and the
    redo program of a capacity build is the dropless build's own entry."""
    moe = dict(model="deepseek_v3", ep=2)
    dropless = _factors(**moe)
    assert "moe capacity" not in dropless
    capped, dropping = _factors(**moe, moe_capacity=1.25), _factors(**moe, moe_capacity=1.25, moe_drop=True)
    assert describe_differences(dropless, capped) == ['moe capacity None -> {"factor": 1.25, "overflow": "redo dropless"}']
    assert len({digest(dropless), digest(capped), digest(dropping)}) == 3
    assert digest(build_factors(make_spec(**(DEBUG | moe), moe_capacity=1.25).dropless())) == digest(dropless)


def test_builder_version_changes_with_any_builder_or_runtime_source(tmp_path, monkeypatch):
    # A pass, a model or the tracer changed must miss the cache, not only builder/spec/.
    import shutil

    from titan.builder.spec import cache_key

    for name, path in cache_key.versioned_sources():
        copy = tmp_path / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
    monkeypatch.setattr(cache_key, "SOURCE_ROOTS", {pkg: tmp_path / pkg for pkg in ("builder", "runtime")})
    names = {name for name, _ in cache_key.versioned_sources()}
    assert {"builder/passes/regions.py", "builder/trace/rank_trace.py", "builder/spec/cache_key.py",
            "runtime/train.py", "runtime/kernels/fusion.py"} <= names
    versions = {cache_key.builder_version()}
    for edited in ("builder/passes/regions.py", "builder/models/llama3/model.py", "runtime/contract/graph_decode.py"):
        with open(tmp_path / edited, "a") as f:
            f.write("\n# edited\n")
        versions.add(cache_key.builder_version())
    assert len(versions) == 4

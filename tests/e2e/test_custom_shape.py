"""A model of your own shape: dimensions set on top of a flavor (titan-build --vocab-size, --dim,
..., --shape FIELD=VALUE) are checked as the flavors are, get their own artifact name and cache
key, and train bitwise equal to eager."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_every_rank_equals_eager, titan
from titan.builder.spec.build_spec import make_spec
from titan.builder.spec.cache_key import build_factors, digest
from titan.builder.models import MODELS

LAYOUT = dict(tp=2, dp_shard=1, dp_replicate=1, batch_size=None, seq_len=None)


@pytest.mark.slow
def test_a_custom_vocabulary_and_width_train_bitwise_equal_to_eager(tmp_path):
    art = tmp_path / "custom"
    r = titan("build", "--flavor", "debug", "--tp", 2, "--vocab-size", 1000, "--dim", 128, "--out", art)
    assert r.returncode == 0, r.stderr
    assert f"building {art}: llama3 debug, dim 128, vocab_size 1000, 2 rank(s)" in r.stdout
    config = json.loads((art / "manifest.json").read_text())["model_config"]
    assert (config["vocab_size"], config["dim"], config["n_heads"]) == (1000, 128, 8)
    assert_every_rank_equals_eager(art, tmp_path, steps=3, ranks=2)


def test_a_custom_shape_is_its_own_cache_entry_and_name():
    flavor = make_spec(model="llama3", flavor="debug", **LAYOUT)
    shaped = make_spec(model="llama3", flavor="debug", shape={"vocab_size": "1000"}, **LAYOUT)
    assert shaped.cfg.vocab_size == 1000 and flavor.cfg.vocab_size == 2048
    assert digest(build_factors(shaped)) != digest(build_factors(flavor))
    assert (flavor.name, shaped.name) == ("llama3-debug-tp2", "llama3-debug-vocab_size1000-tp2")


@pytest.mark.parametrize("model, shape, message", [
    ("llama3", {"vocab_size": 1001}, "--tp 2 does not divide the vocabulary size (1001)"),
    ("llama3", {"n_kv_heads": 1}, "--tp 2 does not divide the key/value heads (1)"),
    ("llama3", {"dim": 100}, "dim 100 is not a multiple of n_heads 8"),
    ("llama3", {"dim": 8}, "the head width dim / n_heads = 1 is odd"),
    ("llama3", {"n_heads": 4, "n_kv_heads": 8}, "n_kv_heads 8 does not divide n_heads 4"),
    ("llama3", {"vocab": 1000}, "llama3 has no dimension 'vocab'; its config's fields are: dim, n_layers,"),
    ("llama3", {"dim": "wide"}, "llama3 dim = 'wide' is not an integer"),
    ("llama3", {"n_layers": 0}, "n_layers must be at least 1"),
    ("deepseek_v3", {"n_kv_heads": 2}, "deepseek_v3 has no dimension 'n_kv_heads'"),
    ("deepseek_v3", {"top_k": 9}, "top_k 9 is more than the 4 experts a token can choose from"),
    ("deepseek_v3", {"n_expert_groups": 3}, "n_expert_groups 3 does not divide n_routed_experts 8"),
    ("deepseek_v3", {"n_dense_layers": 4}, "n_dense_layers 4 is more than n_layers 3"),
])
def test_a_shape_that_breaks_a_rule_is_refused_with_the_rule(model, shape, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        make_spec(model=model, flavor="debug", shape=shape, **LAYOUT)


def test_deepseek_v3_takes_its_own_dimensions():
    spec = make_spec(model="deepseek_v3", flavor="debug", shape={"moe_hidden": "16", "vocab_size": "600"}, **LAYOUT)
    assert (spec.cfg.moe_hidden, spec.cfg.vocab_size) == (16, 600)
    assert spec.name == "deepseek_v3-debug-moe_hidden16-vocab_size600-tp2"


@pytest.mark.parametrize("model", list(MODELS))
def test_each_flavor_passes_its_own_shape_rules_and_counts_its_parameters(model):
    family = MODELS[model]
    for cfg in family.flavors.values():
        family.check_shape(cfg)
    cfg = family.flavors["debug"]
    with torch.device("meta"):
        built = family.build(cfg)
    assert cfg.n_params == sum(p.numel() for p in built.parameters())

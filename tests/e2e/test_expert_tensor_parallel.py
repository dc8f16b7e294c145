"""Expert tensor parallelism (`titan-build --etp`, builder/models/moe/expert_tp.py) through
titan-build and titan-verify as a user runs them (real gloo processes, the debug flavors): every
step's loss and every parameter on every rank torch.equal to the eager reference with the same
layout, at DeepSeek-V3 tp 2 x ep 2, dp-shard 2 x tp 2 x ep 2 and tp 2 alone and Qwen3 MoE tp 2 x
ep 2; each rank holds half of every expert's hidden width; the losses are those of the same layout
without expert TP within rounding; a layout --etp does not fit gets one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import titan

pytestmark = pytest.mark.slow  # 4 and 8 CPU ranks, each build and verify a minute or more

BATCH, SEQ = 2, 64
STEPS = 3
LAYOUTS = {
    "deepseek-tp2-ep2": ("deepseek_v3", "debug", {"tp": 2, "ep": 2}, 47),
    "deepseek-dp-shard2-tp2-ep2": ("deepseek_v3", "debug", {"dp_shard": 2, "tp": 2, "ep": 2}, 47),
    "qwen3-tp2-ep2": ("qwen3", "debug-moe", {"tp": 2, "ep": 2}, 38),
    "deepseek-tp2": ("deepseek_v3", "debug", {"tp": 2}, 47),  # no ep: the experts split over tp alone
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """artifact(name, *extra) -> the built artifact of LAYOUTS[name] (built once)."""
    root = tmp_path_factory.mktemp("etp")
    built: dict[tuple, Path] = {}

    def get(name: str, *extra: str) -> Path:
        key = (name, *extra)
        if key not in built:
            model, flavor, layout, _ = LAYOUTS[name]
            out = root / "-".join(key).replace("--", "")
            flags = [x for dim, size in layout.items() for x in (f"--{dim.replace('_', '-')}", size)]
            r = titan("build", "--model", model, "--flavor", flavor, "--batch-size", BATCH, "--seq-len", SEQ,
                      *flags, *extra, "--out", out)
            assert r.returncode == 0, r.stdout + r.stderr
            built[key] = out
        return built[key]

    return get


def _verify(art: Path, tmp_path: Path, *, ranks: int, params: int) -> list[float]:
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", STEPS, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout
    assert f"parameters after step {STEPS}: all bitwise equal ({params} tensors per rank, {ranks} ranks)" in r.stdout
    result = json.loads(out.read_text())
    assert result["parameters_differing"] == 0 and result["eager"] == result["artifact"]
    return [float.fromhex(h) for h in result["artifact"]]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_tp_is_bitwise_equal_to_eager_on_every_rank(name, artifact, tmp_path):
    model, _, layout, params = LAYOUTS[name]
    ranks = math.prod(layout.values())
    art = artifact(name, "--etp", "2")
    _verify(art, tmp_path, ranks=ranks, params=params)
    # Each tp rank holds half of every routed expert's hidden width: w1/w3 cut on dim 1, w2 on dim 2,
    # then the ep slice (and FSDP's) on dim 0; the dispatch routes the whole sequence.
    r = titan("show", art, "--rank", 1, "--graph", "fw")
    assert r.returncode == 0, r.stderr
    assert ", expert_tp 2" in r.stdout
    assert f"tokens_per_rank {BATCH * SEQ}," in r.stdout
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["model_config"]["etp"] == 2


def test_expert_tp_trains_the_model_that_whole_experts_train(artifact, tmp_path):
    """The same global weights and data: with and without expert TP the losses agree within
    rounding (the partial sums over tp and the gathered routing add in another order)."""
    with_etp = _verify(artifact("deepseek-tp2-ep2", "--etp", "2"), tmp_path, ranks=4, params=47)
    whole = _verify(artifact("deepseek-tp2-ep2"), tmp_path, ranks=4, params=47)
    assert with_etp == pytest.approx(whole, rel=1e-5)


def test_an_etp_that_is_not_the_tp_degree_gets_one_line(tmp_path):
    r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", "--tp", 2, "--ep", 2, "--etp", 4,
              "--out", tmp_path / "art")
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: --etp 4: expert tensor parallel splits each routed expert over the --tp "
                                "ranks, so it is 1 or the --tp degree (2); use --etp 1 or --etp 2")
    assert not (tmp_path / "art").exists()

"""The contract: training from an artifact gives losses torch.equal to eager PyTorch with the
same parallelism, seed and data, at every step."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import assert_every_rank_equals_eager, read_metrics, titan
from titan.runtime.contract.artifact import open_artifact

LAYOUTS = [dict(tp=2), dict(dp_shard=2), dict(tp=2, dp_shard=2)]
STEPS = 10


def _losses(hexes: list[str]) -> torch.Tensor:
    return torch.tensor([float.fromhex(h) for h in hexes], dtype=torch.float64)


# tp 2 x dp-shard 2 covers both in the default tier; each alone joins the long one (CI time).
@pytest.mark.parametrize("layout", [lo if len(lo) == 2 else pytest.param(lo, marks=pytest.mark.slow) for lo in LAYOUTS],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_artifact_losses_equal_eager_at_every_step(layout, debug_artifact, tmp_path):
    art = debug_artifact(**layout)
    result = assert_every_rank_equals_eager(art, tmp_path, steps=STEPS, ranks=math.prod(layout.values()))
    eager, artifact = _losses(result["eager"]), _losses(result["artifact"])
    assert len(eager) == STEPS
    for step in range(STEPS):
        assert torch.equal(eager[step], artifact[step]), f"step {step + 1}: {eager[step]} != {artifact[step]}"
    # titan-run (a separate job) reproduces the artifact column exactly.
    metrics = tmp_path / "metrics.jsonl"
    r = titan("run", art, "--steps", STEPS, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    recs = read_metrics(metrics)
    assert [rec["step"] for rec in recs] == list(range(1, STEPS + 1))
    assert torch.equal(torch.tensor([rec["loss"] for rec in recs], dtype=torch.float64), artifact)
    assert all(rec["tokens_per_s"] > 0 and rec["step_time_s"] > 0 for rec in recs)
    assert artifact[-1] < artifact[0], "the loss should fall over ten steps"


@pytest.mark.slow
def test_uneven_fsdp_shards_are_padded_and_equal_eager_on_every_rank(debug_artifact, tmp_path):
    """dp_shard=3 divides no parameter's rows in the debug model (vocabulary 2048, width 256,
    key/value rows 128, feed-forward 704): each rank holds torch.chunk's rows padded to a full
    chunk, as FSDP2 does, and trains bit for bit like eager with the same sharding, every
    step's loss and every parameter after the last step, on each of the three ranks."""
    art = debug_artifact(dp_shard=3)
    last = open_artifact(art).rank_record(2)
    shapes = {p.fqn: (p.global_shape, p.local_shape) for p in last.params}
    assert shapes["tok_embeddings.weight"] == ((2048, 256), (683, 256))  # rows 1366..2047 and 1 row of padding
    assert shapes["layers.0.feed_forward.w1.weight"] == ((704, 256), (235, 256))
    result = assert_every_rank_equals_eager(art, tmp_path, steps=4, ranks=3)
    assert len(result["eager"]) == 4


@pytest.mark.slow
def test_hsdp_losses_equal_eager(debug_artifact, tmp_path):
    art = debug_artifact(dp_replicate=2, dp_shard=2)
    r = titan("verify", art, "--steps", 3)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout


@pytest.mark.slow
def test_token_file_data_equal_eager(debug_artifact, tmp_path):
    art = debug_artifact(dp_shard=2)
    tokens = torch.randint(0, 2048, (4096,), generator=torch.Generator().manual_seed(1)).to(torch.int32)
    data = tmp_path / "tokens.u16"
    data.write_bytes(tokens.numpy().astype("uint16").tobytes())
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", 3, "--data", data, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["eager"] == result["artifact"]
    synthetic = tmp_path / "synthetic.json"
    assert titan("verify", art, "--steps", 3, "--json", synthetic).returncode == 0
    assert json.loads(synthetic.read_text())["artifact"] != result["artifact"], "--data was not read"


def test_torchrun_ranks_train_like_spawned_ranks(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    spawned, launched = tmp_path / "spawned.jsonl", tmp_path / "torchrun.jsonl"
    assert titan("run", art, "--steps", 3, "--metrics", spawned).returncode == 0
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "titan.cli.run",
                        str(art), "--steps", "3", "--metrics", str(launched)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [x["loss"] for x in read_metrics(spawned)] == [x["loss"] for x in read_metrics(launched)]

"""A bounded MoE dispatch through titan-build, titan-run, titan-verify and titan-show (real gloo
processes, DeepSeek-V3 debug at ep 2):

- `--moe-capacity F` alone stays dropless: at a capacity where some steps overflow and others
  do not (both asserted), every step's loss and every parameter on every rank equals the
  dropless eager model bit for bit; the overflowing steps were redone (the per-step metrics and
  the run summary say which; held-out losses equal eager's too), and titan-build and titan-show report the capacity and the
  memory it saves.
- `--moe-capacity F --moe-drop` drops: titan-verify refuses to compare it with the dropless
  model unless told (--moe-drop: then it equals eager dropping alike), and the dropped assignments in titan-run's metrics equal a
  count made by hand from the router's choices (the same step on eager expert-parallel ranks).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import read_metrics, titan
from deepseek_debug import CFG, debug_weights, run_ep_ranks
from titan.runtime.data import SyntheticTokens

BATCH, SEQ = 2, 64  # per data-parallel rank, as tests/e2e/test_expert_parallel_bitwise.py (its dropless build is shared)
REDO_FACTOR = 1.1  # at this shape and seed, 4 of the first 10 steps overflow
STEPS = 10
# Each test builds (the bounded artifact and, once per session, the dropless one it carries) and
# runs titan-verify or titan-run and eager gloo ranks: 60-80 s each on the loaded 2-core machine.
pytestmark = pytest.mark.slow


def _build(out, *extra):
    r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", "--ep", 2, "--batch-size", BATCH, "--seq-len", SEQ,
              *extra, "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_bounded_dispatch_is_bitwise_dropless_and_redoes_overflowing_steps(tmp_path):
    art = tmp_path / "cap"
    built = _build(art, "--moe-capacity", REDO_FACTOR)
    tokens = BATCH * SEQ
    capacity, dropless = math.ceil(REDO_FACTOR * tokens * CFG.top_k / 2), tokens * CFG.top_k
    assert f"memory: MoE capacity {REDO_FACTOR}: {2 * capacity:,} dispatch rows per buffer instead of {2 * dropless:,}" \
        in built
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["moe_capacity"] == {"factor": REDO_FACTOR, "drop": False} and len(manifest["redo_programs"]) == 1

    out, val = tmp_path / "verify.json", tmp_path / "val.u16"
    # Held-out batches too: their loss is the dropless forward's (cut down to the loss), uncounted.
    val.write_bytes(torch.randint(0, CFG.vocab_size, (40 * (SEQ + 1),), generator=torch.Generator().manual_seed(9))
                    .numpy().astype(np.uint16).tobytes())
    r = titan("verify", art, "--steps", STEPS, "--json", out, "--val-data", val, "--val-every", 5, "--val-steps", 2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parameters after step 10: all bitwise equal" in r.stdout and "bitwise equal: yes" in r.stdout
    result = json.loads(out.read_text())
    assert [s for s, _ in result["artifact_val_loss"]] == [5, 10]
    assert result["artifact_val_loss"] == result["eager_val_loss"]
    redone = result["artifact_moe_redone"]
    assert any(redone) and not all(redone), f"steps redone {redone}: both kinds of step must occur"
    overflowed = sum(1 for n in redone if n)
    assert f"MoE capacity overflow: {overflowed} of {STEPS} step(s) redone dropless" in r.stdout

    metrics = tmp_path / "m.jsonl"
    r = titan("run", art, "--steps", STEPS, "--metrics", metrics)
    assert r.returncode == 0, r.stdout + r.stderr
    records = read_metrics(metrics)
    assert [rec["moe_redone"] for rec in records] == redone
    assert all((rec["moe_overflow"] > 0) == bool(rec["moe_redone"]) for rec in records)
    assert all(rec["dropped_tokens"] == 0 for rec in records)  # what was kept is the dropless step's
    assert [float.fromhex(x) for x in result["artifact"]] == [rec["loss"] for rec in records]

    r = titan("show", art, "--graph", "fw")
    assert r.returncode == 0, r.stderr
    assert f"capacity {capacity}, buffer_rows {2 * capacity}, dropless False, capacity_factor {REDO_FACTOR}" in r.stdout
    assert f"moe capacity: factor {REDO_FACTOR:g}, dropless: an overflowing micro-batch is redone" in r.stdout


def _step_one_batch() -> dict[str, torch.Tensor]:
    """Step 1's synthetic batch of both data-parallel ranks, as the worker splits a global batch
    (rank r takes rows r::2)."""
    per_rank = [SyntheticTokens(vocab_size=CFG.vocab_size, batch_size=BATCH, seq_len=SEQ, seed=0, dp_rank=r).batch(0)
                for r in range(2)]
    tokens, labels = (torch.stack([per_rank[r][i][row] for row in range(BATCH) for r in range(2)]) for i in range(2))
    return {"tokens": tokens, "labels": labels}


def test_drop_and_pad_is_labeled_and_its_dropped_counts_equal_a_hand_count(tmp_path):
    factor = 1.0
    art = tmp_path / "drop"
    _build(art, "--moe-capacity", factor, "--moe-drop")
    r = titan("verify", art, "--steps", 1)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error: this artifact drops the MoE assignments past capacity 1") \
        and "pass --moe-drop" in r.stderr

    r = titan("verify", art, "--steps", 2, "--moe-drop")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the eager reference drops past MoE capacity 1 too (--moe-drop: not the dropless model)" in r.stdout
    assert "bitwise equal: yes" in r.stdout

    metrics = tmp_path / "m.jsonl"
    r = titan("run", art, "--steps", 1, "--metrics", metrics)
    assert r.returncode == 0, r.stdout + r.stderr
    reported = read_metrics(metrics)[0]["dropped_tokens"]

    # The same step (seeded weights, step 1's batch) on two eager expert-parallel ranks that drop
    # at the same capacity; each MoE layer's router choices on each rank, counted by hand: rank s
    # sends rank d the assignments to d's experts, and what passes `capacity` is dropped.
    ranks = run_ep_ranks(tmp_path / "eager", debug_weights(seed=0), _step_one_batch(),
                         extra=("--capacity-factor", str(factor), "--routing"))
    capacity = math.ceil(factor * BATCH * SEQ * CFG.top_k / 2)
    per_rank = CFG.n_routed_experts // 2
    blocks = [int((out[key] // per_rank == dest).sum()) for out in ranks for key in out if key.startswith("eager.routing.")
              for dest in range(2)]
    assert len(blocks) == 2 * 2 * CFG.n_moe_layers
    hand = sum(max(0, n - capacity) for n in blocks)
    assert hand > 0 and min(blocks) < capacity, f"blocks {blocks} of {capacity}: the count would prove little"
    assert reported == hand

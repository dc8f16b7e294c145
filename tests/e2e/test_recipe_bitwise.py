"""The training recipe end to end (real gloo processes, debug models): warmup + cosine decay +
clipping + 4-way gradient accumulation bitwise equal to eager PyTorch's own LambdaLR,
clip_grad_norm_ and autograd accumulation on every rank (losses, gradient norms, parameters);
a clip that triggers on some steps and not on others; a config file equal to its flags; a
resume mid-warmup with an odd accumulation count equal to the uninterrupted run."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import read_metrics, titan

RECIPE = ("--lr", "3e-3", "--warmup-steps", 2, "--decay-type", "cosine", "--min-lr-factor", "0.1",
          "--max-norm", "1.0", "--accumulation-steps", 4, "--beta2", "0.99", "--weight-decay", "0.05")
STEPS = 4


@pytest.fixture(scope="module")
def deepseek_ep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek") / "ep2"
    r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", "--batch-size", 2, "--seq-len", 64, "--ep", 2,
              "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _verify(art: Path, tmp_path: Path, *args, ranks: int, params: int) -> dict:
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--json", out, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout
    assert f"all bitwise equal ({params} tensors per rank, {ranks} ranks)" in r.stdout
    result = json.loads(out.read_text())
    assert result["eager"] == result["artifact"] and result["eager_grad_norm"] == result["artifact_grad_norm"]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp-shard2-tp2", "deepseek-ep2"])
def test_warmup_cosine_clipping_and_accumulation_equal_eager_on_every_rank(layout, debug_artifact, deepseek_ep2,
                                                                            tmp_path):
    art, ranks, params = {"tp2": (lambda: debug_artifact(tp=2), 2, 21),
                          "dp-shard2-tp2": (lambda: debug_artifact(tp=2, dp_shard=2), 4, 21),
                          "deepseek-ep2": (lambda: deepseek_ep2, 2, 47)}[layout]
    result = _verify(art(), tmp_path, "--steps", STEPS, *RECIPE, ranks=ranks, params=params)
    assert len(result["artifact_grad_norm"]) == STEPS


def _run(art: Path, metrics: Path, *args) -> list[dict]:
    r = titan("run", art, "--metrics", metrics, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return read_metrics(metrics)


@pytest.mark.slow
def test_a_clip_that_triggers_on_some_steps_and_not_others_equals_eager(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    recipe = ("--steps", 8, "--lr", "3e-3", "--accumulation-steps", 2)
    free = _run(art, tmp_path / "free.jsonl", *recipe)
    norms = [r["grad_norm"] for r in free]
    # A threshold between the run's gradient norms: the first step stays under it or goes over.
    max_norm = statistics.median(norms)
    result = _verify(art, tmp_path, *recipe, "--max-norm", repr(max_norm), ranks=2, params=21)
    clipped_norms = [float.fromhex(h) for h in result["artifact_grad_norm"]]
    over = [n > max_norm for n in clipped_norms]
    assert any(over) and not all(over), (max_norm, clipped_norms)
    # Until the first clipped step the run is the unclipped one; after it, it is not (AdamW is
    # nearly blind to a scale close to 1 for a step or two, so not necessarily at the next step).
    first = over.index(True)
    losses = [float.fromhex(h) for h in result["artifact"]]
    assert losses[:first + 1] == [r["loss"] for r in free[:first + 1]]
    assert losses[first + 1:] != [r["loss"] for r in free[first + 1:]]


@pytest.mark.slow
def test_a_config_file_run_equals_the_same_flags_and_flags_win(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    job = tmp_path / "job.toml"
    job.write_text('[build]\nflavor = "debug"\ntp = 2\n\n[run]\nsteps = 5\nlr = 3e-3\nwarmup_steps = 2\n'
                   'decay_type = "cosine"\nmax_norm = 1.0\naccumulation_steps = 4\nbeta2 = 0.99\nweight_decay = 0.05\n'
                   'min_lr_factor = 0.1\n')
    from_file = _run(art, tmp_path / "file.jsonl", "--config", job, "--steps", STEPS)  # the flag wins over steps = 5
    from_flags = _run(art, tmp_path / "flags.jsonl", "--steps", STEPS, *RECIPE)
    keys = ("step", "loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in from_file] == [[r[k] for k in keys] for r in from_flags]
    assert len(from_file) == STEPS and from_file[0]["lr"] == 1.5e-3
    header = json.loads((tmp_path / "file.jsonl").read_text().splitlines()[0])["config"]
    assert header["steps"] == STEPS and header["accumulation_steps"] == 4 and header["decay_type"] == "cosine"


@pytest.mark.slow
def test_resume_mid_warmup_with_odd_accumulation_equals_the_uninterrupted_run(debug_artifact, tmp_path):
    """Three micro-batches per step, a checkpoint at step 2 of a 3-step warmup: the resumed
    run continues the schedule, the data and the optimizer exactly; another schedule is refused."""
    art = debug_artifact(tp=2)
    recipe = ("--steps", 4, "--lr", "3e-3", "--warmup-steps", 3, "--decay-type", "linear", "--max-norm", "0.5",
              "--accumulation-steps", 3)
    whole = _run(art, tmp_path / "whole.jsonl", *recipe)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    _run(art, metrics, *recipe, "--checkpoint-dir", ckpt, "--checkpoint-every", 2)
    shutil.rmtree(ckpt / "step-00000004")  # as if stopped after step 2
    other = titan("run", art, *recipe[:4], "--warmup-steps", 2, *recipe[6:], "--checkpoint-dir", ckpt, "--resume")
    assert other.returncode == 2 and "--warmup-steps 2 here, 3 there" in other.stderr, other.stderr
    assert "--resume-with-changes" in other.stderr
    resumed = _run(art, metrics, *recipe, "--checkpoint-dir", ckpt, "--resume")
    keys = ("step", "loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]


@pytest.mark.slow
def test_validation_loss_equals_eager_forward_and_leaves_training_alone(deepseek_ep2, tmp_path):
    """Held-out loss every 2 steps on DeepSeek-V3 ep 2 (whose forward updates the balancing
    bias: validation must not), bitwise eager's forward loss; the training losses are those of
    a run without validation."""
    val = tmp_path / "val.u16"
    val.write_bytes(torch.randint(0, 512, (20 * 65 + 1,), generator=torch.Generator().manual_seed(9))
                    .numpy().astype(np.uint16).tobytes())
    recipe = ("--steps", STEPS, "--accumulation-steps", 2, "--max-norm", "1.0")
    result = _verify(deepseek_ep2, tmp_path, *recipe, "--val-data", val, "--val-every", 2, "--val-steps", 2,
                     ranks=2, params=47)
    assert [s for s, _ in result["artifact_val_loss"]] == [2, 4]
    assert result["artifact_val_loss"] == result["eager_val_loss"]
    without = _run(deepseek_ep2, tmp_path / "plain.jsonl", *recipe)
    assert [r["loss"] for r in without] == [float.fromhex(h) for h in result["artifact"]]

"""The training recipe: the LR schedule, AdamW's options, clipping by global norm, gradient
accumulation, the config file; each bitwise against PyTorch's own pieces."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from processes import torchrun_envs
from titan.runtime.lr_schedule import LRSchedule
from titan.runtime.optim import AdamW

WORKER = Path(__file__).parent.parent / "clip_worker.py"


def schedule(**kw) -> LRSchedule:
    args = dict(lr=1e-3, steps=20, warmup_steps=4, decay_type="cosine", decay_ratio=None, min_lr_factor=0.1)
    return LRSchedule.for_run(**{**args, **kw})


def test_warmup_then_decay_reaches_the_minimum_factor():
    s = schedule()
    assert [s.factor(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(4) == 1.0 and s.factor(19) > 0.1
    assert math.isclose(s.factor(19), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert all(a > b for a, b in zip([s.factor(k) for k in range(4, 20)], [s.factor(k) for k in range(5, 20)]))


def test_warmup_stable_decay_holds_the_peak_until_the_decay_ratio():
    s = schedule(decay_type="linear", decay_ratio=0.25, min_lr_factor=0.0)
    assert (s.warmup_steps, s.stable_steps, s.decay_steps) == (4, 11, 5)
    assert [s.factor(k) for k in range(4, 15)] == [1.0] * 11
    assert [s.factor(k) for k in range(15, 20)] == [1.0, 0.8, 0.6, 0.4, 0.19999999999999996]
    assert schedule(decay_type="sqrt", decay_ratio=0.25).factor(16) == 0.1 + 0.9 * (1 - math.sqrt(0.2))


@pytest.mark.parametrize("bad, message", [
    (dict(warmup_steps=30), "--warmup-steps 30 is more than --steps 20"),
    (dict(decay_ratio=0.9), "--decay-ratio 0.9 decays over 18 steps"),
])
def test_a_schedule_that_does_not_fit_the_run_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        schedule(**bad)


def test_adamw_with_a_schedule_is_torch_adamw_with_lambda_lr_bitwise():
    """Warmup + cosine and non-default betas, eps and weight decay: the LR is the same Python
    float in both, every step."""
    s = schedule(steps=12, warmup_steps=3)
    options = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(16, 8, generator=g), torch.randn(8, generator=g)]
    theirs = [p.clone() for p in ours]
    opt = AdamW(ours, lr=s.lr, schedule=s, **options)
    ref = torch.optim.AdamW(theirs, lr=s.lr, foreach=False, **options)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(ref, s.factor)
    for _ in range(12):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        lr_then = ref.param_groups[0]["lr"]
        opt.step()
        ref.step()
        lambda_lr.step()
        assert opt.lr == lr_then
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


def _clip_ranks(mesh: str, world: int, max_norm: str) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, str(WORKER), mesh, max_norm], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for env in torchrun_envs(world)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outs)]


@pytest.mark.parametrize("mesh, world, max_norm", [
    ("dp_shard=2,tp=2", 4, "1.0"),
    ("dp_replicate=2,ep=2", 4, "none"),
    ("tp=3", 3, "0.5"),
])
def test_global_norm_clip_is_clip_grad_norm_on_dtensors_bitwise(mesh, world, max_norm):
    """Every mix of sharded and replicated placements on 1-D and 2-D meshes (a dimension of 3
    too): the norm and the clipped gradients equal torch.nn.utils.clip_grad_norm_ (or
    get_total_norm) on the same gradients as DTensors, on every rank."""
    runs = _clip_ranks(mesh, world, max_norm)
    for rank, r in enumerate(runs):
        assert r.returncode == 0, f"rank {rank}: {r.stdout[-2000:]}"
    if max_norm != "none":
        assert "clipped True" in runs[0].stdout


@pytest.mark.parametrize("text, words", [
    ("[run]\nwarmup = 3\n", ["[run] has no key 'warmup'", "warmup_steps"]),
    ("[run]\nmax_norm = -1.0\n", ["[run] max_norm", "-1.0"]),
    ("[run]\ndecay_type = \"exp\"\n", ["[run] decay_type", "'exp' is not one of"]),
    ("[run]\nresume = 1\n", ["[run] resume must be true or false"]),
    ("[run\n", ["is not TOML", "docs/configs/"]),
])
def test_a_bad_config_file_is_one_error_line_naming_the_key(text, words, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(text)
    r = subprocess.run([sys.executable, "-m", "titan.cli.run", str(tmp_path), "--config", str(job)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr

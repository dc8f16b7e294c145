"""DCP checkpoints: a resumed run continues with exactly the losses of an uninterrupted one, a
checkpoint moves between layouts exactly, and bad checkpoints are refused losing nothing.
(Padded shards and their checkpointed rows, in process: unit/test_shards.py.)"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import read_metrics, titan
from processes import default_sigint

PROBE_RESHARD = """
# Load a checkpoint into this artifact's layout and save it again, through the runtime's own
# checkpoint functions (no training step in between).
import sys
from pathlib import Path
import torch
from titan.runtime import checkpoint
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.distributed import RankEnv, exit_rank, init_process_group, shutdown
from titan.runtime.recipe import Recipe
from titan.runtime.train import make_optimizer

env = RankEnv.from_environ()
init_process_group(env, torch.device("cpu"))
art = open_artifact(sys.argv[1])
params = art.rank_record(env.rank).params
tensors = [torch.full(p.local_shape, float("nan")) for p in params]
optimizer = make_optimizer(tensors, Recipe.constant(0.0))
for buf in optimizer.exp_avg + optimizer.exp_avg_sq:
    buf.fill_(float("nan"))
state = checkpoint.load(Path(sys.argv[2]), params=params, tensors=tensors, optimizer=optimizer)
checkpoint.save(sys.argv[3], state["step"], params=params, tensors=tensors, optimizer=optimizer,
                description=dict(state, layout=art.layout.as_dict()))
shutdown()
exit_rank(0)
"""

FAMILIES = ("model", "optim.exp_avg", "optim.exp_avg_sq")


def _losses(path: Path) -> list[float]:
    # --metrics writes json floats (repr of the float64 value of an fp32 loss): exact.
    return [rec["loss"] for rec in read_metrics(path)]


def _run(art, *args):
    r = titan("run", art, *args)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.slow
def test_resume_after_ctrl_c_reproduces_the_uninterrupted_losses_and_metrics_file(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    whole, metrics, ckpt = (tmp_path / n for n in ("whole.jsonl", "metrics.jsonl", "ckpt"))
    # Ctrl-C a long run just past its checkpoint at step 10 (the metrics' header + 11 steps), so that its metrics go beyond it
    # (the next checkpoint is steps away, however late the signal lands on a loaded machine).
    p = subprocess.Popen([sys.executable, "-m", "titan.cli.run", str(art), "--steps", "100000", "--checkpoint-dir",
                          str(ckpt), "--checkpoint-every", "10", "--metrics", str(metrics)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 12):
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGINT)
        assert p.wait(timeout=60) == 130
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    interrupted_at = read_metrics(metrics)[-1]["step"]
    latest = max(int(d.name.split("-")[1]) for d in ckpt.iterdir() if d.name.startswith("step-"))
    assert latest < interrupted_at, "the test needs steps after the last checkpoint"
    total = interrupted_at + 2
    _run(art, "--steps", total, "--checkpoint-dir", ckpt, "--resume", "--metrics", metrics)
    _run(art, "--steps", total, "--metrics", whole)
    # The resumed file is the uninterrupted run's: every step once, the same losses.
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, total + 1))
    resumed = torch.tensor(_losses(metrics), dtype=torch.float64)
    uninterrupted = torch.tensor(_losses(whole), dtype=torch.float64)
    assert torch.equal(resumed, uninterrupted), (resumed, uninterrupted)
    assert f"step-{total:08d}" in {p.name for p in ckpt.iterdir()}
    state = json.loads((ckpt / f"step-{total:08d}" / "titan.json").read_text())
    assert (state["step"], state["optimizer_steps"], state["layout"]["tp"]) == (total, total, 2)


def test_a_fresh_run_never_truncates_a_metrics_file(debug_artifact, tmp_path):
    metrics = tmp_path / "run.jsonl"
    metrics.write_text('{"step": 1, "loss": 7.0, "tokens_per_s": 1.0, "step_time_s": 1.0}\n')
    line = _one_error(titan("run", debug_artifact(tp=2), "--steps", 2, "--metrics", metrics))
    assert f"--metrics {metrics} already holds" in line and "--resume" in line
    assert metrics.read_text().count("\n") == 1


@pytest.mark.slow
def test_resume_with_other_settings_is_refused_naming_each_or_taken_with_the_override(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    ckpt, data = tmp_path / "ckpt", tmp_path / "tokens.bin"
    _random_tokens(data)
    _run(art, "--steps", 2, "--checkpoint-dir", ckpt, "--data", data, "--seed", 3)
    cases = [(("--data", data, "--seed", 4), ["--seed 4 here, 3 there"]),
             (("--data", data, "--seed", 3, "--lr", "1e-3"), ["--lr 0.001 here, 0.0008 there"]),
             (("--seed", 3), [f"--data none (synthetic tokens) here, {data} there"]),
             (("--seed", 5), ["--seed 5 here, 3 there", "--data none"])]
    for args, words in cases:
        line = _one_error(titan("run", art, "--steps", 3, "--checkpoint-dir", ckpt, "--resume", *args))
        assert "was trained with other settings" in line and "--resume-with-changes" in line, line
        for w in words:
            assert w in line, line
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002"]
    _run(art, "--steps", 3, "--checkpoint-dir", ckpt, "--resume", "--data", data, "--seed", 4, "--resume-with-changes")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]


def _random_tokens(path: Path, n: int = 4096) -> None:
    g = torch.Generator().manual_seed(0)
    path.write_bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.int16).numpy().tobytes())


@pytest.mark.slow
@pytest.mark.parametrize("dp_shard", [2, 3])
def test_tp_checkpoint_trains_on_fsdp_like_a_fresh_fsdp_run(dp_shard, debug_artifact, tmp_path):
    """The seeded initial weights, checkpointed by tp=2 (step 0), resumed on dp_shard=2 (or on
    dp_shard=3, whose shards are padded): the same losses, bit for bit, as that layout starting
    from the seed itself."""
    tp, fsdp = debug_artifact(tp=2), debug_artifact(dp_shard=dp_shard)
    ckpt, resumed, fresh = tmp_path / "ckpt", tmp_path / "resumed.jsonl", tmp_path / "fresh.jsonl"
    _run(tp, "--steps", 0, "--checkpoint-dir", ckpt)
    _run(fsdp, "--steps", 3, "--checkpoint-dir", ckpt, "--resume", "--metrics", resumed)
    _run(fsdp, "--steps", 3, "--metrics", fresh)
    assert _losses(resumed) == _losses(fresh)


@pytest.mark.slow
@pytest.mark.parametrize("dp_shard, fsdp_rows", [(2, {128}), (3, {86, 84})])
def test_reshard_fsdp_checkpoint_to_tp_exactly(dp_shard, fsdp_rows, debug_artifact, tmp_path):
    """A trained dp_shard=2 checkpoint (parameters and AdamW state) loaded by tp=2 ranks and
    saved again holds exactly the same global tensors, though cut into other boxes. With
    dp_shard=3 the shards are padded, and only their real rows are saved."""
    from titan.runtime.checkpoint import load_full

    tp, fsdp = debug_artifact(tp=2), debug_artifact(dp_shard=dp_shard)
    ckpt, out = tmp_path / "ckpt", tmp_path / "resharded"
    _run(fsdp, "--steps", 2, "--checkpoint-dir", ckpt)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE_RESHARD)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(probe), str(tp),
                        str(ckpt / "step-00000002"), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    before, after = load_full(ckpt / "step-00000002", families=FAMILIES), load_full(out / "step-00000002",
                                                                                   families=FAMILIES)
    assert before[1].keys() == after[1].keys()
    for key, tensor in before[1].items():
        assert not tensor.isnan().any(), key
        assert torch.equal(tensor, after[1][key]), key
    assert after[0]["optimizer_steps"] == 2
    # Not trivially the same files: FSDP cut wo by rows, tp by columns.
    with safe_open(next((ckpt / "step-00000002").glob("*.safetensors")), "pt") as f:
        fsdp_box = f.get_slice("model.layers.0.attention.wo.weight").get_shape()
    with safe_open(next((out / "step-00000002").glob("*.safetensors")), "pt") as f:
        tp_box = f.get_slice("model.layers.0.attention.wo.weight").get_shape()
    assert fsdp_box[0] in fsdp_rows and (fsdp_box[1], tp_box) == (256, [256, 128])


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.slow
def test_bad_checkpoints_are_refused_and_nothing_is_lost(debug_artifact, tmp_path):
    art = debug_artifact(tp=2)
    ckpt = tmp_path / "ckpt"
    _run(art, "--steps", 2, "--checkpoint-dir", ckpt)
    digest = _tree_digest(ckpt)

    line = _one_error(titan("run", art, "--steps", 4, "--checkpoint-dir", tmp_path / "none", "--resume"))
    assert "no such directory" in line and "drop --resume" in line  # found before torch is imported
    (tmp_path / "empty").mkdir()
    line = _one_error(titan("run", art, "--steps", 4, "--checkpoint-dir", tmp_path / "empty", "--resume"))
    assert "no complete checkpoint" in line and "drop --resume" in line
    line = _one_error(titan("run", art, "--steps", 4, "--resume"))
    assert "--resume needs --checkpoint-dir" in line
    line = _one_error(titan("run", art, "--steps", 4, "--checkpoint-dir", ckpt))
    assert "already holds checkpoints (latest step 2)" in line and "--resume" in line
    line = _one_error(titan("run", art, "--steps", 2, "--checkpoint-dir", ckpt, "--resume"))
    assert "already at step 2" in line and "--steps > 2" in line
    line = _one_error(titan("run", art, "--steps", 4, "--checkpoint-dir", ckpt, "--resume", "--seed", 5))
    assert "--seed 5 here, 0 there" in line
    assert _tree_digest(ckpt) == digest, "a refused run must not touch the checkpoints"

    other = tmp_path / "other"
    (other / "step-00000002").mkdir(parents=True)
    for f in (ckpt / "step-00000002").iterdir():
        (other / "step-00000002" / f.name).write_bytes(f.read_bytes())
    state_file = other / "step-00000002" / "titan.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps(dict(state, model_config=dict(state["model_config"], dim=512))))
    line = _one_error(titan("run", art, "--steps", 4, "--checkpoint-dir", other, "--resume"))
    assert "different model" in line and "dim 512 (artifact: 256)" in line
    state_file.write_text("{not json")
    # A garbled description is not a complete checkpoint of the newest step: refused, not skipped.
    assert "not readable JSON" in _one_error(titan("run", art, "--steps", 4, "--checkpoint-dir", other, "--resume"))

    state_file.write_text(json.dumps(state))
    next(state_file.parent.glob("shard-00001-*.safetensors")).unlink()
    line = _one_error(titan("run", art, "--steps", 4, "--checkpoint-dir", other, "--resume"))
    assert "do not cover it" in line

    # A crashed save leaves only a partial directory: resuming ignores it and the next save of
    # that step replaces it.
    (ckpt / ".step-00000003.partial").mkdir()
    (ckpt / ".step-00000003.partial" / "junk").write_text("x")
    _run(art, "--steps", 3, "--checkpoint-dir", ckpt, "--resume")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]
    assert {k: v for k, v in _tree_digest(ckpt).items() if k.startswith("step-00000002")} == digest


@pytest.mark.parametrize("args, words", [
    (("--checkpoint-every", 2), ["--checkpoint-every needs --checkpoint-dir"]),
    (("--resume", "--checkpoint-dir", "ckpt", "--init-from-hf", "hf"), ["pass only one of them"]),
])
def test_inconsistent_checkpoint_options_are_refused(args, words, debug_artifact, tmp_path):
    args = [str(tmp_path / a) if a in ("ckpt", "hf") else a for a in args]
    line = _one_error(titan("run", debug_artifact(tp=2), "--steps", 2, *args))
    for w in words:
        assert w in line, line

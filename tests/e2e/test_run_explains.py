"""A run explains itself (issue 33): what it is and what it starts from before any rank starts,
start-up phases while they run, and one summary paragraph at the end; a mistake that can be
found before the ranks start is found there, before torch is imported."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys

import numpy as np

from conftest import read_metrics, titan


def _summary(out: str) -> str:
    last = out.strip().splitlines()[-1]
    assert last.startswith("done: "), out
    return last


def test_a_run_says_what_it_starts_from_and_ends_with_one_summary(debug_artifact, tmp_path):
    art = debug_artifact()
    data = tmp_path / "tokens.bin"
    np.arange(5_000, dtype="<u2").tofile(data)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    r = titan("run", art, "--steps", 2, "--data", data, "--checkpoint-dir", ckpt, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = f"titan-run {art}: llama3 debug, 1 rank(s) [single], batch 2 x seq 128, float32"
    # Other tests run this artifact too: their start-up time may be told already.
    assert re.fullmatch(re.escape(header) + r"( \(step 1 came \d+\.\d s after start last time\))?", lines[0]), lines[0]
    start = [line for line in lines if line.startswith("start: ")]
    assert start == [f"start: fresh weights (seeded init, seed 0), to train steps 1-2; data: {data} (5,000 tokens, "
                     f"uint16); checkpoints to {ckpt} at the last step"]
    assert lines.index(start[0]) < lines.index("starting 1 rank(s)") < min(
        i for i, line in enumerate(lines) if line.startswith("step "))
    records = read_metrics(metrics)
    summary = _summary(r.stdout)
    assert re.match(r"done: 2 step\(s\) in \d+\.\d s; start-up \d+\.\d s to the end of the first step \(", summary)
    assert (f"; median {statistics.median(m['tokens_per_s'] for m in records):,.0f} tokens/s; loss "
            f"{records[0]['loss']:.4f} at step 1, {records[1]['loss']:.4f} at step 2; peak memory ") in summary

    resumed = titan("run", art, "--steps", 3, "--data", data, "--checkpoint-dir", ckpt, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert re.fullmatch(re.escape(header) + r" \(step 1 came \d+\.\d s after start last time\)",
                        resumed.stdout.splitlines()[0]), resumed.stdout
    assert f"start: resuming from {ckpt / 'step-00000002'} (step 2), to train steps 3-3; data: {data}" in resumed.stdout
    assert "loss " in _summary(resumed.stdout) and "at step 3, " in _summary(resumed.stdout)


def test_a_missing_file_is_refused_before_torch_is_imported(debug_artifact, tmp_path):
    art = debug_artifact()
    for args, message in (
            (("--data", tmp_path / "nope.bin"), f"error: --data {tmp_path / 'nope.bin'}: no such file; write a token "
                                                 "file with titan-data"),
            (("--init-from-hf", tmp_path), f"error: --init-from-hf {tmp_path}: no config.json there; give a "
                                           "Hugging Face model directory"),
            (("--checkpoint-dir", tmp_path / "none", "--resume"), f"error: --resume --checkpoint-dir {tmp_path / 'none'}:"
                                                                  " no such directory")):
        # In-process, so that what was imported can be seen: the check comes before torch.
        code = ("import sys\nfrom titan.cli.run import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
                "    print('torch imported:', 'torch' in sys.modules, 'exit', e.code)")
        r = subprocess.run([sys.executable, "-c", code, str(art), *map(str, args)], capture_output=True, text=True,
                           timeout=120)
        assert r.stderr.startswith(message) and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stdout.splitlines()[-1] == "torch imported: False exit 2", r.stdout


def test_a_run_that_cannot_fit_the_host_is_refused_before_any_rank_starts(tmp_path):
    huge = tmp_path / "huge"  # 31 billion parameters: no test host holds their AdamW state
    b = titan("build", "--flavor", "debug", "--vocab-size", 60_000_000, "--out", huge)
    assert b.returncode == 0, b.stderr
    for command in ("run", "verify"):
        r = titan(command, huge, "--steps", 1)
        assert r.returncode == 2 and r.stdout == "", r.stdout
        assert re.fullmatch(r"error: the 1 rank\(s\) need at least 458\.2 GiB \(0\.4 GiB per process, parameters, "
                            r"gradients, AdamW state and saved activations\) but this host has [\d.]+ GiB, which its "
                            r"ranks share; build a smaller model \(e\.g\. --flavor debug\), layout or batch, or run it on "
                            r"GPUs\n", r.stderr), r.stderr


def test_the_job_start_is_torchruns_for_its_ranks_and_the_process_start_otherwise():
    """A rank that torchrun's agent started times its start-up from the agent's start (issue 33:
    0.9 s was recorded for a 17 s start), as titan-run's ranks do from titan-run's."""
    from titan.runtime.startup import _process_start
    code = "from titan.runtime.startup import job_started; print(repr(job_started()))"
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_RUN_STARTED", "TORCHELASTIC_RUN_ID")}
    under_torchrun = subprocess.run([sys.executable, "-c", code], env=dict(env, TORCHELASTIC_RUN_ID="x"),
                                    capture_output=True, text=True, check=True)
    assert float(under_torchrun.stdout) == _process_start(os.getpid())  # this process plays the agent
    alone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(alone.stdout) > _process_start(os.getpid())
    spawned = subprocess.run([sys.executable, "-c", code], env=dict(env, TITAN_RUN_STARTED="1234.5"),
                             capture_output=True, text=True, check=True)
    assert float(spawned.stdout) == 1234.5

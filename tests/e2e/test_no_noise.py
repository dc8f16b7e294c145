"""No noise (issue 30): on the CPU paths a user takes, the terminal shows titan's own lines and
nothing else: no library warning, deprecation notice or traceback, on stdout or stderr.

One flow on the debug flavor, as the walkthrough runs it (docs/walkthrough.md): a cold build
into a build cache of its own and the same build again (a cache hit), titan-data, a few steps of
titan-run with a checkpoint and metrics, titan-verify, titan-show, titan-report, titan-export.
(The GPU's first run printed inductor's cache warnings: unit/test_plan_recorder_pickle.py.)"""

from __future__ import annotations

import os
import re

import pytest

from conftest import titan

NOISE = re.compile(r"warn|traceback|deprecat", re.IGNORECASE)
LINES = ["the quick brown fox jumps over the lazy dog", "a titan trains from an artifact",
         "tokens flow from text to the model", "every rank reads its own window of the file"]


def _quiet(result, what: str) -> str:
    """The command's output, after checking it succeeded and printed no noise."""
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{what} failed:\n{out}"
    noisy = [line for line in out.splitlines() if NOISE.search(line)]
    assert not noisy, f"{what} printed what is not titan's:\n" + "\n".join(noisy)
    return out


@pytest.mark.slow
def test_the_cpu_flow_prints_titans_lines_and_nothing_else(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("matplotlib")  # titan-report's plot
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))  # a cold build, then a hit
    art, ckpt = tmp_path / "art", tmp_path / "ckpt"

    cold = _quiet(titan("build", "--flavor", "debug", "--tp", 2, "--out", art, env=env), "a cold titan-build")
    assert "cache: miss" in cold
    hit = _quiet(titan("build", "--flavor", "debug", "--tp", 2, "--out", art, "--replace", env=env),
                 "titan-build from the cache")
    assert "cache: hit" in hit

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, tokenizers.trainers.BpeTrainer(vocab_size=120,
                                                                  special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("\n".join(LINES * 60) + "\n")
    data = tmp_path / "train.bin"
    _quiet(titan("data", tmp_path / "a.txt", "-o", data, "--tokenizer", tmp_path / "tokenizer.json"), "titan-data")

    metrics = tmp_path / "m.jsonl"
    run = _quiet(titan("run", art, "--steps", 3, "--data", data, "--metrics", metrics, "--checkpoint-dir", ckpt,
                       "--checkpoint-every", 3, env=env), "titan-run")
    assert "step    3/3" in run
    assert "bitwise equal: yes" in _quiet(titan("verify", art, "--steps", 2, env=env), "titan-verify")
    assert "forward graph of rank 0" in _quiet(titan("show", art), "titan-show")
    _quiet(titan("report", metrics, "-o", tmp_path / "report.png", "--summary"), "titan-report")
    _quiet(titan("export", ckpt, "--hf", tmp_path / "hf"), "titan-export")
    assert (tmp_path / "hf" / "model.safetensors").exists() or any((tmp_path / "hf").glob("*.safetensors"))

"""Option values are checked where they are read, for every command: nonsense (zero or negative
counts, NaN or infinite floats, empty paths, absurd sizes, options that do not apply) is refused
with one `error:` line and exit status 2, before any work starts. And there is one run path: a
rank started by torchrun checks the run's options as titan-run does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import titan
from processes import torchrun_envs

ART = "{art}"  # replaced by the session's debug tp=2 artifact


def _one_error(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    return lines[0]


@pytest.mark.parametrize("command, args, words", [
    ("build", ("--flavor", "debug", "--batch-size", 0), ["--batch-size", "x>=1"]),
    ("build", ("--flavor", "debug", "--seq-len", 0), ["--seq-len", "x>=2"]),
    ("build", ("--flavor", "debug", "--tp", 0), ["--tp"]),
    ("build", ("--flavor", "debug", "--jobs", 0), ["--jobs", "x>=1"]),
    ("build", ("--flavor", "debug", "--jobs", -3), ["--jobs"]),
    ("build", ("--flavor", "debug", "--cache-dir", ""), ["--cache-dir", "empty path"]),
    ("build", ("--flavor", "debug", "--out", ""), ["--out", "empty path"]),
    ("build", ("--flavor", "debug", "--batch-size", 10**12), ["tokens per rank"]),
    ("build", ("--flavor", "debug", "--dtype", "fp16"), ["--dtype"]),
    ("build", ("--flavor", "debug", "--bogus",), ["no such option"]),
    ("run", (ART, "--steps", 0), ["--steps 0 trains nothing", "--checkpoint-dir"]),
    ("run", (ART, "--lr", "nan"), ["--lr", "finite"]),
    ("run", (ART, "--lr", "-1"), ["--lr", "> 0"]),
    ("run", (ART, "--lr", "inf"), ["--lr", "finite"]),
    ("run", (ART, "--lr", "0"), ["--lr", "> 0"]),
    ("run", (ART, "--timeout", "nan"), ["--timeout", "finite"]),
    ("run", (ART, "--timeout", "0"), ["--timeout"]),
    ("run", (ART, "--seed", "-1"), ["--seed"]),
    ("run", (ART, "--batch-size", 0), ["--batch-size"]),
    ("run", (ART, "--batch-size", 10**12), ["--batch-size 1000000000000 differs from the artifact's 2"]),
    ("run", (ART, "--metrics", ""), ["--metrics", "empty path"]),
    ("run", (ART, "--checkpoint-every", 0), ["--checkpoint-every"]),
    ("run", (ART, "--resume-with-changes"), ["only applies with --resume"]),
    ("run", (), ["missing argument"]),
    ("verify", (ART, "--lr", "nan"), ["--lr", "finite"]),
    ("verify", (ART, "--steps", 0), ["--steps"]),
    ("cache", ("--cache-dir", "", "ls"), ["--cache-dir", "empty path"]),
    ("cache", ("lss",), ["no such command"]),
    ("diff", (ART, "--ranks", 0, -1), ["--ranks"]),
    ("show", (ART, "--rank", -1), ["--rank"]),
    ("report", ("{tmp}/none.jsonl",), ["does not exist"]),
    ("export", ("{tmp}", "--hf", ""), ["--hf", "empty path"]),
])
def test_nonsense_option_values_are_one_error_line(command, args, words, debug_artifact, tmp_path):
    needs_art = ART in args
    args = [str(a).format(art=debug_artifact(tp=2) if needs_art else "", tmp=tmp_path) for a in args]
    line = _one_error(titan(command, *args, env=dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
                            if command == "build" else None))
    for w in words:
        assert w in line, line


def test_tiktoken_spec_with_a_tokenizer_json_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=50, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world\n")
    line = _one_error(titan("data", tmp_path / "a.txt", "-o", tmp_path / "t.bin", "--tokenizer",
                            tmp_path / "tokenizer.json", "--tiktoken-spec", "llama3"))
    assert "--tiktoken-spec applies to tiktoken ranks files" in line


def test_a_torchrun_rank_refuses_a_mismatched_batch_size_as_titan_run_does(debug_artifact):
    art = debug_artifact()  # one rank: world size 1 under torchrun's variables
    spawned = _one_error(titan("run", art, "--batch-size", 4))
    [env] = torchrun_envs(1)
    rank = subprocess.run([sys.executable, "-m", "titan.cli.run", str(art), "--batch-size", "4"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert _one_error(rank) == spawned
    assert "--batch-size 4 differs from the artifact's 2" in spawned

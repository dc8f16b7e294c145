"""No noise (issue 30): on the CPU paths a user takes, the terminal shows titan's own lines and
nothing else: no library warning, deprecation notice or traceback, on stdout or stderr.

One flow on the debug flavor, as the walkthrough runs it (docs/walkthrough.md): a cold build
into a build cache of its own and the same build again (a cache hit), titan-data, a few steps of
titan-run with a checkpoint, metrics and TensorBoard scalars, titan-verify, titan-show, titan-diff
(two ranks, two builds), titan-cache ls / info / verify, titan-report, titan-export. Then the
refusals a user meets: a mistaken option or path (one `error:` line each, in well under a second,
most before torch is imported) and an artifact that is not what it should be (a rank outside it, an
edited graph). (The GPU's first run printed inductor's cache warnings:
unit/test_plan_recorder_pickle.py.)"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from conftest import titan

NOISE = re.compile(r"warn|traceback|deprecat", re.IGNORECASE)
LINES = ["the quick brown fox jumps over the lazy dog", "a titan trains from an artifact",
         "tokens flow from text to the model", "every rank reads its own window of the file"]


def _no_noise(out: str, what: str) -> None:
    noisy = [line for line in out.splitlines() if NOISE.search(line)]
    assert not noisy, f"{what} printed what is not titan's:\n" + "\n".join(noisy)


def _quiet(result, what: str, *, code: int = 0) -> str:
    """The command's output, after checking it exited with `code` and printed no noise."""
    out = result.stdout + result.stderr
    assert result.returncode == code, f"{what} exited {result.returncode}, not {code}:\n{out}"
    _no_noise(out, what)
    return out


def _refused(result, what: str) -> str:
    """The one `error:` line of a refusal (exit status 2), after checking it is the only one, is
    the last line, and nothing else printed is noise."""
    out = _quiet(result, what, code=2)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and out.splitlines()[-1] == errors[0], f"{what}: not one error line last:\n{out}"
    return errors[0]


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
    tensorboard = ("--tensorboard", tmp_path / "tb") if _has("tensorboard") else ()
    run = _quiet(titan("run", art, "--steps", 3, "--data", data, "--metrics", metrics, "--checkpoint-dir", ckpt,
                       "--checkpoint-every", 3, *tensorboard, env=env), "titan-run")
    assert "step    3/3" in run
    assert "bitwise equal: yes" in _quiet(titan("verify", art, "--steps", 2, env=env), "titan-verify")
    assert "forward graph of rank 0" in _quiet(titan("show", art), "titan-show")
    _quiet(titan("diff", art, "--ranks", 0, 1), "titan-diff of two ranks", code=1)  # 1: they differ
    _quiet(titan("diff", art, art), "titan-diff of two builds")
    listing = _quiet(titan("cache", "ls", env=env), "titan-cache ls")
    key = listing.splitlines()[1].split()[0]  # the one entry's key, under the header
    assert "factors:" in _quiet(titan("cache", "info", key, env=env), "titan-cache info")
    assert "0 corrupt" in _quiet(titan("cache", "verify", env=env), "titan-cache verify")
    _quiet(titan("report", metrics, "-o", tmp_path / "report.png", "--summary"), "titan-report")
    _quiet(titan("export", ckpt, "--hf", tmp_path / "hf"), "titan-export")
    assert (tmp_path / "hf" / "model.safetensors").exists() or any((tmp_path / "hf").glob("*.safetensors"))


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


# Mistakes in what a user gives, refused before any work: each command's own checks.
MISTAKES = [
    ("run", "{missing}"),
    ("verify", "{missing}"),
    ("show", "{missing}"),
    ("diff", "{missing}", "--ranks", "0", "1"),
    ("build", "--flavor", "nope"),
    ("build", "--tp", "3"),
    ("build", "--flavor", "debug", "--tp", "0"),
    ("run", "{missing}", "--lr", "nan"),
    ("cache", "info", "zzz"),
    ("data", "{missing}", "-o", "{tmp}/out.bin", "--tokenizer", "{missing}.json"),
    ("report", "{missing}"),
    ("export", "{missing}", "--hf", "{tmp}/hf"),
]


@pytest.mark.parametrize("args", MISTAKES, ids=[" ".join(m) for m in MISTAKES])
def test_a_mistake_is_one_error_line_and_nothing_else(args, tmp_path):
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    filled = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in args]
    _refused(titan(*filled, env=env), "titan-" + " ".join(args))


@pytest.mark.slow
def test_refusals_of_an_artifact_print_titans_lines_and_nothing_else(debug_artifact, tmp_path):
    """Past the option checks: a rank outside the artifact, a run that trains nothing, no GPU for
    --device cuda, and an artifact whose graph was edited after the build (titan-run and
    titan-verify check every file before a rank starts; the tools check what they print)."""
    art = debug_artifact(tp=2)
    assert "outside" in _refused(titan("show", art, "--rank", 9), "titan-show --rank 9")
    assert "outside" in _refused(titan("diff", art, "--ranks", 0, 5), "titan-diff --ranks 0 5")
    _refused(titan("run", art, "--steps", 0), "titan-run --steps 0")
    import torch
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in _refused(titan("run", art, "--device", "cuda"), "titan-run --device cuda")
    edited = tmp_path / "edited"
    shutil.copytree(art, edited)
    graph = max((edited / "graphs").iterdir(), key=lambda f: f.stat().st_size)
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    for command in ("run", "verify", "show"):
        _refused(titan(command, edited, "--steps", 1) if command != "show" else titan(command, edited),
                 f"titan-{command} of an edited artifact")

"""Every command, given what a user can get wrong (values out of range, NaN and infinities, wrong
types, missing and unreadable paths, directories, special files, /proc paths, deep or garbled
JSON), answers with exactly one `error: ...` line on stderr and exit status 2: never a
traceback. Each case is a real process (a traceback only shows in one); they run a few at a
time, and most fail before torch is imported."""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys

import pytest

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def paths(tmp_path_factory, debug_artifact) -> dict[str, str]:
    root = tmp_path_factory.mktemp("matrix")
    (root / "dir").mkdir()
    (root / "file").write_text("plain text, not what any command wants\n")
    (root / "empty").write_bytes(b"")
    (root / "deep.json").write_text(DEEP)
    (root / "garbled.json").write_text('{"step": 1, "loss": ')
    (root / "binary").write_bytes(bytes(range(256)) * 16)
    os.mkfifo(root / "fifo")
    for name, manifest in (("art-deep", DEEP), ("art-garbled", "{nope"), ("art-list", "[1, 2]")):
        (root / name).mkdir()
        (root / name / "manifest.json").write_text(manifest)
    (root / "art-fifo").mkdir()
    os.mkfifo(root / "art-fifo" / "manifest.json")
    (root / "art-link").mkdir()
    (root / "art-link" / "manifest.json").symlink_to("/dev/zero")
    (root / "hf-deep").mkdir()
    (root / "hf-deep" / "config.json").write_text(DEEP)
    art = debug_artifact()
    return {"MISSING": str(root / "missing"), "DIR": str(root / "dir"), "FILE": str(root / "file"),
            "EMPTY": str(root / "empty"), "DEEP": str(root / "deep.json"), "GARBLED": str(root / "garbled.json"),
            "BINARY": str(root / "binary"), "FIFO": str(root / "fifo"), "UNDER_FILE": str(root / "file" / "x"),
            "PROC": "/proc/self/status", "PROC_DIR": "/proc/self", "PROC_NEW": "/proc/self/titan-out",
            "DEV": "/dev/zero", "ART": str(art), "ART_DEEP": str(root / "art-deep"),
            "ART_GARBLED": str(root / "art-garbled"), "ART_LIST": str(root / "art-list"),
            "ART_FIFO": str(root / "art-fifo"), "ART_LINK": str(root / "art-link"), "HF_DEEP": str(root / "hf-deep"),
            "OUT": str(root / "out")}


BAD_ARTIFACTS = ["MISSING", "DIR", "FILE", "FIFO", "PROC_DIR", "UNDER_FILE", "ART_DEEP", "ART_GARBLED", "ART_LIST",
                 "ART_FIFO", "ART_LINK"]
BAD_JSON_FILES = ["MISSING", "DIR", "EMPTY", "DEEP", "GARBLED", "BINARY", "FIFO", "PROC", "DEV", "UNDER_FILE"]
BAD_READ_FILES = ["MISSING", "DIR", "FIFO", "DEV", "PROC", "UNDER_FILE"]
BAD_OUT_DIRS = ["FILE", "UNDER_FILE", "PROC_NEW"]

CASES: list[tuple[str, ...]] = [
    *[("run", a, "--steps", "1") for a in BAD_ARTIFACTS],
    *[("verify", a, "--steps", "1") for a in BAD_ARTIFACTS],
    *[("show", a) for a in BAD_ARTIFACTS],
    *[("diff", a, "--ranks", "0", "1") for a in BAD_ARTIFACTS],
    *[("diff", "ART", a) for a in ("MISSING", "ART_DEEP", "ART_FIFO")],
    *[("export", a, "--hf", "OUT") for a in ("MISSING", "FILE", "DIR", "FIFO", "PROC_DIR", "UNDER_FILE")],
    *[("report", m, "--summary") for m in BAD_JSON_FILES],
    *[("data", "FILE", "-o", "OUT", "--tokenizer", t) for t in BAD_JSON_FILES],
    *[("data", t, "-o", "OUT", "--tokenizer", "DEEP") for t in ("MISSING", "DIR", "FIFO")],
    *[("run", "ART", "--steps", "1", "--data", d) for d in BAD_READ_FILES + ["EMPTY", "FILE"]],
    *[("run", "ART", "--steps", "1", "--init-from-hf", h) for h in ("MISSING", "FILE", "DIR", "HF_DEEP", "PROC_DIR")],
    *[("run", "ART", "--steps", "1", "--checkpoint-dir", c) for c in BAD_OUT_DIRS],
    *[("run", "ART", "--steps", "1", "--metrics", m) for m in ("DIR", "UNDER_FILE", "PROC_NEW")],
    *[("cache", "--cache-dir", c, sub) for c in BAD_OUT_DIRS for sub in ("ls", "verify")],
    ("cache", "info", "no-such-key"), ("cache", "gc"), ("cache", "gc", "--max-size", "lots"),
    ("cache", "gc", "--older-than", "nan"), ("cache", "gc", "--max-size", "-5G"),
    ("cache", "gc", "--older-than", "inf"), ("cache", "gc", "--max-size", "inf"),
    *[("build", "--flavor", "debug", *bad) for bad in (
        ("--tp", "0"), ("--tp", "-1"), ("--tp", "abc"), ("--tp", "3"), ("--dp-shard", "0"), ("--dp-replicate", "0"),
        ("--batch-size", "-1"), ("--batch-size", "inf"), ("--seq-len", "1"), ("--seq-len", "nan"), ("--flavor", "nope"), ("--model", "nope"),
        ("--dtype", "fp8"), ("--passes", "nope"), ("--ac", "most"), ("--partitioner", "best"), ("--fuse", "all"),
        ("--out", "FILE"), ("--out", "UNDER_FILE"), ("--cache-dir", "FILE"), ("--cache-dir", "UNDER_FILE"))],
    *[("run", "ART", *bad) for bad in (
        ("--steps", "-1"), ("--steps", "abc"), ("--steps", "1.5"), ("--steps", "inf"), ("--lr", "abc"),
        ("--seed", "abc"), ("--seed", "nan"),
        ("--batch-size", "999"), ("--seq-len", "7"), ("--checkpoint-every", "0"), ("--device", "tpu"),
        ("--timeout", "0"), ("--timeout", "abc"), ("--data-dtype", "int8"),
        ("--max-norm", "0"), ("--decay-type", "exp"), ("--warmup-steps", "-1"), ("--warmup-steps", "999"),
        ("--decay-ratio", "1.5"), ("--accumulation-steps", "0"), ("--global-batch-size", "3"),
        ("--val-every", "2"), ("--val-data", "MISSING"), ("--beta2", "nan"), ("--config", "MISSING"),
        ("--config", "DIR"))],
    *[("verify", "ART", *bad) for bad in (("--steps", "0"), ("--steps", "abc"), ("--device", "tpu"))],
    *[("show", "ART", *bad) for bad in (("--rank", "99"), ("--rank", "-1"), ("--graph", "xx"), ("--rank", "abc"))],
    *[("diff", "ART", *bad) for bad in (("--ranks", "0", "99"), ("--max-lines", "-1"), ("--graph", "xx"))],
]


def _run(case: tuple[str, ...], paths: dict[str, str]) -> subprocess.CompletedProcess:
    cmd, *args = case
    args = [paths.get(a, a) for a in args]
    return subprocess.run([sys.executable, "-m", f"titan.cli.{cmd}", *args], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def results(paths):
    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(CASES, pool.map(lambda c: _run(c, paths), CASES)))


def test_matrix_covers_every_command_with_at_least_100_cases():
    commands = {c[0] for c in CASES}
    assert commands == {"build", "run", "verify", "show", "diff", "export", "report", "data", "cache"}
    assert len(CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=[" ".join(c) for c in CASES])
def test_one_error_line_and_exit_2(results, case):
    r = results[case]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, f"exit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr

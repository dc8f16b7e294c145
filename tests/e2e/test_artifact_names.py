"""Default artifact names spell out what shapes the graphs, so that two different builds never
replace each other's default artifact silently, and titan-cache ls tells them apart; an explicit
--out holding another build is refused (naming the differences) unless --replace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import titan

DEBUG = ("--flavor", "debug")


def _build(cwd, *args):
    # Run from `cwd` so that the default artifacts/ directory is the test's own.
    return subprocess.run([sys.executable, "-m", "titan.cli.build", *DEBUG, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_builds_differing_only_in_seq_len_never_replace_each_others_artifact(tmp_path, debug_artifact):
    debug_artifact()  # the session cache holds the default single-rank build
    first, second = _build(tmp_path), _build(tmp_path, "--seq-len", 64)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    arts = sorted(p.name for p in (tmp_path / "artifacts").iterdir())
    assert arts == ["llama3-debug-single", "llama3-debug-single-s64"]
    manifests = [json.loads((tmp_path / "artifacts" / a / "manifest.json").read_text()) for a in arts]
    assert [m["seq_len"] for m in manifests] == [128, 64]
    # titan-cache ls shows the two entries as different rows (beyond their keys).
    rows = {row.split()[0]: row.split()[1:-7] for row in titan("cache", "ls").stdout.splitlines()[1:]
            if row.split() and row.split()[0] in {m["cache_key"][:12] for m in manifests}}
    assert len(rows) == 2 and len({" ".join(r) for r in rows.values()}) == 2, rows
    # The same --out: refused, naming the difference; --replace replaces.
    out = tmp_path / "artifacts" / "llama3-debug-single"
    r = _build(tmp_path, "--seq-len", 64, "--out", out)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == (f"error: {out} holds another build (seq len 128 there, 64 now); "
                        "pass --replace to replace it, or --out DIR to write this one elsewhere")
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 128
    assert _build(tmp_path, "--seq-len", 64, "--out", out, "--replace").returncode == 0
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 64

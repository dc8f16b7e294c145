"""titan-build --pp as a user runs it: --pp-plan prints the stage split, the memory per stage and
each pp rank's actions and writes nothing; a pipeline build writes an artifact of its stage
programs and schedule, whose stages come from the cache when only the schedule changes; a
pipeline that cannot work is one error line with the reason. (Training such artifacts:
e2e/test_pipeline_artifacts.py.)"""

from __future__ import annotations

import os

import pytest

from conftest import titan

PLAN = ("--flavor", "debug", "--n-layers", "4", "--pp", "2", "--tp", "2", "--microbatches", "4")


@pytest.mark.slow
def test_the_plan_shows_the_split_memory_and_actions_and_writes_nothing(tmp_path):
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / "art"
    plan = titan("build", *PLAN, "--pp-plan", "--out", out, env=env)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    assert "  stage 0 on pp rank 0: layers 0-1 + embedding; peak micro-batches in flight 2" in lines
    assert "  stage 1 on pp rank 1: layers 2-3 + norm, output, loss; peak micro-batches in flight 1" in lines
    assert any(line.startswith("  stage 1: ") and line.endswith("GiB per rank; 1 micro-batches in flight")
               for line in lines)
    assert ("  pp rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 1RECV_F3 1F3 "
            "1B3 1SEND_B3") in lines
    # Nothing traced or stored (the cache folder holds only the private compiler caches titan-build sets up first).
    assert not out.exists() and [p.name for p in (tmp_path / "cache").iterdir()] == ["private"]

    build = titan("build", *PLAN, "--out", out, env=env)
    assert build.returncode == 0, build.stderr
    assert build.stdout.splitlines()[-1].startswith(f"wrote {out} (") and "2 programs for 4 ranks" in build.stdout
    show = titan("show", out, "--rank", 3, "--graph", "fw", env=env)
    assert show.returncode == 0, show.stderr
    assert "pipeline: this rank is pp rank 1, running stage(s) 1; the schedule of every pp rank:" in show.stdout
    assert any(line.startswith("forward graph of rank 3 stage 1 (layers 2-3)") for line in show.stdout.splitlines())

    # Another schedule of the same split traces nothing: a stage's programs do not depend on it.
    gpipe = titan("build", *PLAN, "--pp-schedule", "gpipe", "--out", tmp_path / "gpipe", env=env)
    assert gpipe.returncode == 0, gpipe.stderr
    assert "cache: hit" in gpipe.stdout and "traced" not in gpipe.stdout.splitlines()[-1]


def test_a_pipeline_that_cannot_work_is_one_line_with_the_reason(tmp_path):
    bad = titan("build", "--flavor", "debug", "--pp", "2", "--pp-split", "2,1", "--out", tmp_path / "art")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == ["error: --pp-split '2,1' holds 3 layers; the model has 2"]

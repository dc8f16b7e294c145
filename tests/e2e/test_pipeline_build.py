"""titan-build --pp as a user runs it: --pp-plan prints the stage split, the memory per stage and
each pp rank's actions and writes nothing; a pipeline build says in one line that stage programs
are not built yet; a pipeline that cannot work is one error line with the reason."""

from __future__ import annotations

import os

from conftest import titan

PLAN = ("--flavor", "debug", "--n-layers", "4", "--pp", "2", "--tp", "2", "--microbatches", "4")


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
    assert build.returncode == 2 and build.stdout == plan.stdout and not out.exists()
    assert build.stderr.splitlines() == ["error: --pp 2: stage programs are not built yet (the split and schedule "
                                         "above are checked; --pp-plan shows them without this error); build with "
                                         "--pp 1"]


def test_a_pipeline_that_cannot_work_is_one_line_with_the_reason(tmp_path):
    bad = titan("build", "--flavor", "debug", "--pp", "2", "--pp-split", "2,1", "--out", tmp_path / "art")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == ["error: --pp-split '2,1' holds 3 layers; the model has 2"]

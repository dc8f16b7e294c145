"""benchmarks/bench_pipeline.py: every row of a pipeline benchmark runs titan's pipeline. The
stages each pp rank holds there (what torchtitan's and the plain-PyTorch rows are given) are the
ones titan's schedule record places, and torchtitan's module names per stage hold exactly
titan's blocks, the embedding first and the norm and output last."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_pipeline import PP_SCHEDULES, TORCH_SCHEDULES, bench_pipeline  # noqa: E402

from titan.builder.spec.pipeline_order import pipeline_schedule  # noqa: E402


@pytest.mark.parametrize("layout", sorted(PP_SCHEDULES))
def test_every_row_gets_titans_stages(layout):
    p = bench_pipeline(layout, flavor="1B", seq_len=2048, microbatches=8)
    record = pipeline_schedule(p.schedule, spans=tuple(p.spans()), microbatches=8, stages_per_rank=p.stages_per_rank)
    assert [sorted(p.stages_of(r)) for r in range(p.pp)] == [
        [s for s in range(record.n_stages) if record.stage_rank[s] == r] for r in range(p.pp)]
    assert tuple(record.stage_layers) == tuple(p.spans())
    fqns = p.module_fqns()
    assert fqns[0][0] == "tok_embeddings" and fqns[-1][-2:] == ["norm", "output"]
    blocks = [[int(f.split(".")[1]) for f in part if f.startswith("layers.")] for part in fqns]
    assert blocks == [list(range(a, b)) for a, b in p.spans()]
    flags = p.titan_flags()
    assert flags[flags.index("--pp-split") + 1] == ",".join(map(str, p.stage_layers))
    assert p.torch_schedule == TORCH_SCHEDULES[PP_SCHEDULES[layout]]


def test_zbv_holds_a_v_and_the_split_is_the_balanced_one():
    p = bench_pipeline("pp2-zbv", flavor="1B", seq_len=2048, microbatches=8)
    assert p.stage_layers == (5, 5, 5, 1)  # the last stage's output projection weighs ~4 blocks at 1B
    assert p.stages_of(0) == [0, 3] and p.stages_of(1) == [1, 2]
    assert bench_pipeline("single", flavor="1B", seq_len=2048, microbatches=8) is None


def test_a_pipeline_that_cannot_work_is_refused_with_titans_reason():
    with pytest.raises(ValueError, match="needs at least 8 layers"):
        bench_pipeline("pp4-zbv", flavor="debug", seq_len=64, microbatches=8)

"""A parallel layout trains the same model as one process: same initial weights (drawn per
parameter, independent of the layout), same global batch. Reductions run in another order, so
the losses are close, not equal; the stated tolerance is relative 1e-5 per step."""

from __future__ import annotations

import pytest

from conftest import read_metrics, titan

REL_TOL = 1e-5
STEPS = 10


# tp 2 x dp-shard 2 in the default tier; each alone joins the long one (CI time).
@pytest.mark.parametrize("layout", [pytest.param(dict(tp=2), marks=pytest.mark.slow),
                                    pytest.param(dict(dp_shard=2), marks=pytest.mark.slow), dict(tp=2, dp_shard=2)],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_parallel_loss_close_to_single_process(layout, debug_artifact, tmp_path):
    dp = layout.get("dp_shard", 1)
    single = debug_artifact(extra=("--batch-size", str(2 * dp)))
    parallel = debug_artifact(**layout)
    curves = []
    for art in (single, parallel):
        metrics = tmp_path / f"{art.name}.jsonl"
        r = titan("run", art, "--steps", STEPS, "--metrics", metrics)
        assert r.returncode == 0, r.stderr
        curves.append([rec["loss"] for rec in read_metrics(metrics)])
    for step, (a, b) in enumerate(zip(*curves), 1):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {step}: single {a} vs {layout} {b}"

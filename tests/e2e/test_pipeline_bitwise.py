"""titan's pipeline executor (runtime/pipeline_executor.py) running the build's schedule record
is bitwise equal to PyTorch's own torch.distributed.pipelining (PipelineStage with ScheduleGPipe /
Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble) on the same stage split: every
step's micro-batch losses and every parameter on every rank after a few AdamW steps, on gloo
ranks, both on eager stages and on the stages' traced programs (builder/trace/stage_trace.py,
read back from the titan graph format by runtime/pipeline_stage.py; zbv's split backward cut from
them by runtime/backward_split.py); and each rank runs its forwards and backwards (B, or I and W)
in the order torch's schedule does. (titan-build does not put stage programs into artifacts yet.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from processes import torchrun_envs

WORKER = Path(__file__).resolve().parents[1] / "pipeline_worker.py"


TWO_STAGES = [("gpipe", 3, "3,1"), ("1f1b", 4, "2,2"), ("interleaved-1f1b", 4, "1,1,1,1")]
"""(schedule, micro-batches, layers per stage) on 2 ranks: an uneven split, the schedules with one
backward (interleaved: two stages per rank)."""
ZERO_BUBBLE = [("zbv", 5, "2,1,1,2")]
"""zbv on 2 ranks: two stages in a V, rank 0 holding the first and the last, rank 1 the two at the
turn, which hand over in memory (the long tier: its split backward traces four stages)."""
MODES = ("titan", "graph")
"""titan's executor on eager stages, and on the stages' traced programs read back from their blobs."""
THREE_STAGES = [("1f1b", 5, "2,1,1"), ("gpipe", 2, "1,2,1"), ("zbv", 4, "1,1,1,1,1,1")]
"""A middle stage, which receives and sends both ways; more micro-batches than stages, and fewer
(zbv: a middle rank in the V, exchanging two streams each way with both neighbours; 4 micro-batches,
fewer than the 2 pp - 1 its layout fills, so some of its steps are idle)."""


def _run(tmp_path: Path, cases: list[tuple], *, ranks: int, steps: int, dp: int = 1) -> list[list[dict]]:
    """Per case, per rank: the worker's results."""
    args = [arg for case in cases for arg in ("--case", ":".join(map(str, case)))] + ["--dp", str(dp)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), *args, "--steps", str(steps)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for env in torchrun_envs(ranks)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-4000:]
    return [[load_file(tmp_path / str(c) / f"rank{r}.safetensors")
             | {"order": json.loads((tmp_path / str(c) / f"rank{r}.json").read_text())} for r in range(ranks)]
            for c in range(len(cases))]


@pytest.mark.parametrize("ranks, dp, cases", [
    (2, 1, TWO_STAGES),
    pytest.param(2, 1, ZERO_BUBBLE, marks=pytest.mark.slow),
    pytest.param(3, 1, THREE_STAGES, marks=pytest.mark.slow),
    # Two pipelines side by side (pp 2 x dp-replicate 2): each rank's peers are in its own pipeline.
    pytest.param(4, 2, [("1f1b", 2, "2,2")], marks=pytest.mark.slow),
], ids=["pp2", "pp2-zbv", "pp3", "pp2-dp2"])
def test_the_executor_runs_each_schedule_bitwise_as_torch_pipelining_does(ranks, dp, cases, tmp_path):
    steps = 2
    for (schedule, microbatches, split), per_rank in zip(cases, _run(tmp_path, cases, ranks=ranks, steps=steps, dp=dp)):
        for rank, result in enumerate(per_rank):
            assert result["order"]["titan"] == result["order"]["torch"], f"{schedule}: rank {rank} runs in another order"
            params = [k.removeprefix("torch.param.") for k in result if k.startswith("torch.param.")]
            for mode in MODES:
                assert params and all(torch.equal(result[f"torch.param.{p}"], result[f"{mode}.param.{p}"])
                                      for p in params), f"{schedule} {mode}: rank {rank}"
        last = next(result for result in per_rank if "torch.loss.0" in result)  # the last stage's rank
        losses = [last[f"torch.loss.{s}"] for s in range(steps)]
        assert all(loss.shape == (microbatches,) for loss in losses) and not torch.equal(losses[0], losses[-1])
        for mode in MODES:
            assert all(torch.equal(last[f"torch.loss.{s}"], last[f"{mode}.loss.{s}"]) for s in range(steps)), \
                f"{schedule} {mode}"

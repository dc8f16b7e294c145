"""A bf16 artifact's forward takes its parameters as their bf16 copies and its backward returns
the copies' gradients (builder/passes/param_casts.py); titan-run keeps the copies, its optimizer
step writes them and reads those gradients upcast (runtime/param_copies.py): the training is
still eager's, bit for bit, with clipping and accumulation, and a resumed run makes its copies
from the checkpoint's parameters. (The captured step's bf16 gradients read by the one-kernel
AdamW and the norm: tests/gpu/test_gpu.py.)"""

from __future__ import annotations

import torch

from conftest import assert_every_rank_equals_eager, read_metrics, titan
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.param_copies import param_grad_dtypes
from titan.runtime.rank_graphs import load_rank_graphs

BF16 = ("--dtype", "bf16")


def test_the_forward_takes_bf16_copies_and_trains_bitwise_equal_to_eager(debug_artifact, tmp_path):
    art = debug_artifact(tp=2, extra=BF16)
    artifact = open_artifact(art)
    for rank in (0, 1):
        inputs = [i for i in artifact.rank_record(rank).forward_inputs if i.kind == "param"]
        assert [i.cast for i in inputs] == ["bfloat16"] * 21
    r = titan("show", art, "--rank", 1, "--graph", "fw")
    assert r.returncode == 0, r.stderr
    inputs = [line for line in r.stdout.splitlines() if " input " in line and ".weight" in line]
    assert len(inputs) == 21 and all("bfloat16[" in line for line in inputs)
    # The backward returns the copies' gradients: bf16, upcast by the runtime as it reads them.
    _, backward = load_rank_graphs(artifact, 1, device=torch.device("cpu"), groups={"tp": "tp"})
    assert param_grad_dtypes(artifact.rank_record(1), backward) == [torch.bfloat16] * 21
    assert_every_rank_equals_eager(art, tmp_path, steps=4, ranks=2,
                                   extra=("--max-norm", "0.05", "--accumulation-steps", "2"))


def test_a_resumed_run_makes_its_copies_from_the_checkpoint(debug_artifact, tmp_path):
    art = debug_artifact(tp=2, extra=BF16)
    ckpt, resumed, whole = tmp_path / "ckpt", tmp_path / "resumed.jsonl", tmp_path / "whole.jsonl"
    for args in (("--steps", 2, "--checkpoint-dir", ckpt),
                 ("--steps", 4, "--checkpoint-dir", ckpt, "--resume", "--metrics", resumed),
                 ("--steps", 4, "--metrics", whole)):
        r = titan("run", art, *args)
        assert r.returncode == 0, r.stderr
    losses = {name: [rec["loss"] for rec in read_metrics(path) if rec["step"] > 2]
              for name, path in (("resumed", resumed), ("whole", whole))}
    assert len(losses["whole"]) == 2
    assert torch.equal(torch.tensor(losses["resumed"], dtype=torch.float64),
                       torch.tensor(losses["whole"], dtype=torch.float64)), losses

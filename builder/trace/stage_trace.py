"""Trace one pipeline stage into a program: its joint forward + backward graph, partitioned
into a forward (what the stage receives -> what it sends on, and the saved activations) and a
backward (saved activations and the gradient of what it sent -> the parameters' gradients and
the gradient of what it received), written in the titan graph format.

A single stage on one rank (no tp or dp-shard inside the stage yet); not yet part of titan-build
(docs/pipeline.md). Call it with the stage on the meta device: it is materialized under fake
tensors, so no memory is used.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode

from titan.builder.trace.rank_trace import PARTITION_FNS, copy_graph_module, module_provenance
from titan.runtime.contract.graph_encode import encode_graph

STAGE_INPUTS = ("tokens", "activations", "labels")
"""What a stage program's forward takes after its parameters, by the stage's place: the first
stage tokens, the others activations (and, under the document mask, the tokens after them), and
the last also labels."""


@dataclass(kw_only=True, frozen=True)
class StageProgram:
    forward: bytes
    """The forward graph: (parameters..., inputs...) -> (output, saved activations...)."""
    backward: bytes
    """The backward graph: (saved activations..., gradient of the output) -> one gradient per
    forward input (None for tokens and labels)."""
    params: tuple[str, ...]
    """The parameters the forward takes first, by name, in order."""
    inputs: tuple[str, ...]
    """Then the stage's inputs (STAGE_INPUTS)."""
    saved: int
    """Saved activations the forward returns after its output."""


def trace_stage(stage: nn.Module, *, inputs: tuple[str, ...], micro_batch: tuple[int, int], dim: int,
                partitioner: str = "min_cut") -> StageProgram:
    """`stage` (on the meta device) traced for micro-batches of `micro_batch` = (sequences, tokens)."""
    assert all(kind in STAGE_INPUTS for kind in inputs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        stage.to_empty(device="cpu")
        examples = tuple(torch.empty(*micro_batch, dim, requires_grad=True) if kind == "activations"
                         else torch.empty(*micro_batch, dtype=torch.long) for kind in inputs)
    with contextlib.ExitStack() as stack:
        stack.enter_context(module_provenance(stage))
        # After what the stage receives, its data goes by keyword (DecoderStage's `tokens`, `labels`).
        kwargs = dict(zip(inputs[1:], examples[1:]))
        joint = aot_export_joint_with_descriptors(stack, stage, examples[:1], kwargs).graph_module
        descs = [n.meta["desc"] for n in joint.graph.nodes if n.op == "placeholder"]
        params = tuple(d.target for d in descs if type(d).__name__ == "ParamAOTInput")
        assert [type(d).__name__ for d in descs] == (["ParamAOTInput"] * len(params) + ["PlainAOTInput"] * len(inputs)
                                                     + ["TangentAOTInput"]), descs
        # The partitioners rewrite the joint graph in place: give them a copy.
        fw, bw = PARTITION_FNS[partitioner](copy_graph_module(joint), None, num_fwd_outputs=1)
    # Encoded after the export context (and its fake mode) has closed: constants are real.
    saved = len(next(n for n in fw.graph.nodes if n.op == "output").args[0]) - 1
    return StageProgram(forward=encode_graph(fw, group_names={}), backward=encode_graph(bw, group_names={}),
                        params=params, inputs=inputs, saved=saved)

"""Runs one pp rank's share of a pipeline step: its actions from the artifact's schedule
(runtime/contract/pipeline_schedule.py), in order, deciding nothing.

Compute actions call the rank's stages (anything with the StageRunner methods: a stage program,
or the eager stages of a test). Each run of consecutive transfers is posted as one
torch.distributed.batch_isend_irecv; the receives are waited for at once (the compute after
them reads their tensors), the sends only at the end of the step (where a backend coalesces a
batch into one request, as NCCL does, a batch with a receive is waited for whole: its
transfers progress together). So a rank never waits on a
send, and a receive waits only for a send its peer posts without waiting: the schedule's check
(run at build and at load) proves that every rank then reaches its end. Every message carries a
tag naming its stage, micro-batch and direction (gloo matches by tag; NCCL by order, which the
check also proves consistent). Between neighbouring stages on this rank (the turn of zbv's V)
there is no transfer: a forward's output is the next stage's input, an input gradient the
previous stage's output gradient, handed over in memory.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol

import torch
import torch.distributed as dist

from titan.runtime.contract.pipeline_schedule import COMPUTE, Action, PipelineSchedule


class StageRunner(Protocol):
    """One pipeline stage on this rank, for every micro-batch of a step."""

    def forward(self, microbatch: int, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Run the stage forward on the micro-batch (the first stage reads its own tokens and gets
        None); return the activations to send on (None from the last stage, which keeps its loss)."""

    def backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Run the stage backward (the last stage from its loss and gets None), adding to its
        parameters' gradients; return the gradient of its input (None from the first stage)."""

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """A zero-bubble schedule's I: the part of the backward the input gradient needs; return
        that gradient as backward does. The parameters' gradients wait for backward_weight."""

    def backward_weight(self, microbatch: int) -> None:
        """A zero-bubble schedule's W: the rest of the micro-batch's backward, adding to the
        parameters' gradients."""

    def input_buffer(self, microbatch: int) -> torch.Tensor:
        """An empty tensor of the stage's input: the received activations land in it."""

    def output_grad_buffer(self, microbatch: int) -> torch.Tensor:
        """An empty tensor of the stage's output: the received gradient lands in it."""


def _tag(schedule: PipelineSchedule, a: Action) -> int:
    """The same number on a send and its receive: the message's receiving stage, micro-batch and direction."""
    forward = a.kind in ("SEND_F", "RECV_F")
    stage = a.stage + 1 if a.kind == "SEND_F" else a.stage - 1 if a.kind == "SEND_B" else a.stage
    return (a.microbatch * schedule.n_stages + stage) * 2 + (0 if forward else 1)


def run_pipeline_step(schedule: PipelineSchedule, *, pp_rank: int, stages: Mapping[int, StageRunner],
                      global_rank: Callable[[int], int], group=None) -> None:
    """Run pp rank `pp_rank`'s actions for one step. `global_rank(p)`: the rank in `group` (default:
    the world) at pp coordinate p with this rank's other coordinates (Layout.pipeline_peer)."""
    received: dict[tuple[str, int, int], torch.Tensor] = {}  # (RECV_F / RECV_B, stage, micro-batch) -> tensor
    to_send: dict[tuple[str, int, int], torch.Tensor] = {}  # (SEND_F / SEND_B, stage, micro-batch) -> tensor
    sends_in_flight, sent = [], []
    actions = schedule.actions[pp_rank]
    i = 0
    while i < len(actions):
        ops, recv_works = [], []
        while i < len(actions) and actions[i].kind not in COMPUTE:
            a = actions[i]
            key = (a.kind, a.stage, a.microbatch)
            if a.kind.startswith("SEND"):
                tensor = to_send.pop(key)
                sent.append(tensor)  # alive until its send completes, whatever the backend's request holds
                ops.append(dist.P2POp(dist.isend, tensor, global_rank(schedule.peer(a)), group, _tag(schedule, a)))
            else:
                stage = stages[a.stage]
                tensor = stage.input_buffer(a.microbatch) if a.kind == "RECV_F" else stage.output_grad_buffer(a.microbatch)
                received[key] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, global_rank(schedule.peer(a)), group, _tag(schedule, a)))
            i += 1
        if ops:
            works = dist.batch_isend_irecv(ops)
            if len(works) == len(ops):  # one request per transfer (gloo)
                for op, work in zip(ops, works):
                    (sends_in_flight if op.op is dist.isend else recv_works).append(work)
            elif any(op.op is dist.irecv for op in ops):  # coalesced (NCCL): done when all its transfers are
                recv_works += works
            else:
                sends_in_flight += works
            for work in recv_works:
                work.wait()
        if i == len(actions):
            break
        a = actions[i]
        stage = stages[a.stage]
        if a.kind == "W":
            stage.backward_weight(a.microbatch)
        else:
            # F sends its output to the next stage; B and I their input gradient to the previous.
            run, recv, send, step = {"F": (stage.forward, "RECV_F", "SEND_F", 1),
                                     "B": (stage.backward, "RECV_B", "SEND_B", -1),
                                     "I": (stage.backward_input, "RECV_B", "SEND_B", -1)}[a.kind]
            out = run(a.microbatch, received.pop((recv, a.stage, a.microbatch), None))
            if out is not None and schedule.local(a.stage, a.stage + step):  # handed over in memory
                received[(recv, a.stage + step, a.microbatch)] = out
            elif out is not None:
                to_send[(send, a.stage, a.microbatch)] = out
        i += 1
    for work in sends_in_flight:
        work.wait()
    assert not to_send and not received, "the schedule's check guarantees every tensor is consumed"

"""A pipeline rank's whole training step captured once in a CUDA graph and replayed every step:
every action of its schedule (its stages' forwards and backwards, the point-to-point transfers
between pipeline ranks), the gradients' mean over micro-batches, the step's loss all-reduced
over the pipeline and, with the one-kernel AdamW, the global gradient norm, the clip and the
update. One replay per step; the host's other work is copying the step's micro-batches into the
graph's input buffers and the optimizer's scalars into theirs (FusedAdamW.prepare).

Why the whole schedule fits one graph: the executor (runtime/pipeline_executor.py) decides
nothing at run time (the order of actions is the artifact's), its buffers are allocated in the
same order every step (so the capture's pool hands out the same addresses on replay), and a wait
on a transfer is a stream dependency under NCCL, not a host wait. Every rank replays its own graph
once per step, so the transfers recorded in each meet as they did in the capture.

Gradients live in the graph's pool and stay in place: after each replay they are handed back to
the parameters' .grad (train_loop clears .grad after the update), and the captured update reads
them where they were at capture.
"""

from __future__ import annotations

from typing import Callable

import torch

from titan.runtime.captured_update import clipped_update
from titan.runtime.cudagraph import WARMUP_STEPS, on_side_stream
from titan.runtime.fused_adamw import FusedAdamW
from titan.runtime.grad_clip import GlobalNormClip
from titan.runtime.startup import rank_phases


class CapturedPipelineStep:
    """`step(batches)` and `update()` for train_loop (its pipeline_step and update). The first
    WARMUP_STEPS steps run eagerly on a side stream (lazy cuBLAS / NCCL set-up, the AdamW kernel's
    compilation and the zero-bubble backward's split must not happen during a capture); the next
    captures and every later one replays. With `optimizer` None (not the one-kernel AdamW) the
    update stays op by op (`update_op_by_op`) after the captured step."""

    def __init__(self, program, *, clip: GlobalNormClip, optimizer: FusedAdamW | None,
                 update_op_by_op: Callable[[], torch.Tensor]):
        self.program, self.clip, self.optimizer = program, clip, optimizer
        self.update_op_by_op = update_op_by_op
        self.warmup_left = WARMUP_STEPS
        self.graph: torch.cuda.CUDAGraph | None = None
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.loss: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.grads: list[torch.Tensor] = []
        self.replayed = False
        """Whether the last step was a replay (its update is already done)."""

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.warmup_left > 0:
            self.warmup_left -= 1
            self.replayed = False
            loss = on_side_stream(self.program.step, batches)
            if self.warmup_left == 0:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # the warm-up's blocks back before the graph takes its pool
            return loss
        if self.optimizer is not None:
            self.optimizer.prepare()  # this step's LR and bias corrections, read by the captured kernels
        if self.graph is None:
            self._capture(batches)
        else:
            for (tokens, labels), (static_tokens, static_labels) in zip(batches, self.batches):
                static_tokens.copy_(tokens)
                static_labels.copy_(labels)
        self.graph.replay()  # a capture records without running: the replay is the step
        self.replayed = True
        for p, g in zip(self.program.params, self.grads):
            p.grad = g
        return self.loss

    def update(self) -> torch.Tensor:
        """The step's update, and the global gradient norm before the clip."""
        if self.replayed and self.optimizer is not None:
            return self.norm  # done inside the step's graph
        if self.optimizer is None:
            return self.update_op_by_op()
        # A warm-up step's, as the capture will do it (compiling the AdamW kernel before the capture).
        self.optimizer.prepare()
        return clipped_update(self.clip, self.optimizer, [p.grad for p in self.program.params])

    def _capture(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = [(tokens.clone(), labels.clone()) for tokens, labels in batches]
        self.graph = torch.cuda.CUDAGraph()
        what = "its schedule" + (", the clip and the optimizer step" if self.optimizer is not None else "")
        with rank_phases()(f"capturing the pipeline step ({what}) in one CUDA graph", short="capture"), \
                torch.cuda.graph(self.graph):
            self.loss = self.program.step(self.batches)
            self.grads = [p.grad for p in self.program.params]
            if self.optimizer is not None:
                self.norm = clipped_update(self.clip, self.optimizer, self.grads)

    def close(self) -> None:
        """Release the graph before the process group goes (a captured graph holds NCCL resources)."""
        if self.graph is not None:
            torch.cuda.synchronize()
            for p in self.program.params:
                p.grad = None
            self.batches, self.grads, self.loss, self.norm = [], [], None, None
            self.graph.reset()
            self.graph = None

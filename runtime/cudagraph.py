"""Forward + backward of a rank captured once in a CUDA graph and replayed every step.

Parameters are static inputs (the optimizer updates them in place, so the graph reads the
new values without a copy); only the batch is copied into the graph's input buffers. The
gradients are the graph's own output buffers (or, over several micro-batches, sums kept in
buffers of their own), handed to the optimizer by reference and never moved, so a captured
optimizer step (runtime/captured_update.py) reads them where they are. Forward
and backward share one capture, hence one memory pool and one capture stream.
"""

from __future__ import annotations

import os

import torch

from titan.runtime.startup import rank_phases

WARMUP_STEPS = 1


def disable_expandable_segments() -> bool:
    """CUDA graphs that capture NCCL collectives misbehave with expandable segments (the
    allocator remaps memory a captured graph still points at); switch them off for this process
    before any allocation. Returns True if the user's setting was overridden."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        return False
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    return True


def on_side_stream(work, *args, side: torch.cuda.Stream | None = None):
    """`work(*args)` run eagerly on a side stream (`side`, else a new one), ordered after and
    before the current one: a warm-up before a capture (lazy cuBLAS / NCCL initialization must
    not happen during one). Repeated warm-ups pass one stream: the caching allocator keeps the
    blocks a stream freed for that stream, so warm-ups on ever new streams add up (an H200 filled
    117 GiB of reserved memory over 90 warm-ups of a 29 GiB step)."""
    side = side or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = work(*args)
    torch.cuda.current_stream().wait_stream(side)
    return result


def hand_out_gradients(program, static: dict) -> torch.Tensor:
    """After a micro-batch's replay: its gradients (`static["grads"]`, the graphs' own buffers)
    to each parameter's .grad (a gradient of the parameter's compute-dtype copy to the copy's
    .grad, which the update reads and upcasts: runtime/param_copies.py), and the loss to return
    (`static["loss"]`)."""
    if program.micro_batches == 1:  # the graph's own buffers, in place every step
        for p, copy, g in zip(program.params, program.copies.copies, static["grads"]):
            if g.dtype == p.dtype:
                p.grad = g
            else:
                p.grad, copy.grad = None, g
    else:  # the next micro-batch's replay rewrites those: sum in buffers of their own, also in place
        sums = static.setdefault("sums", [torch.empty_like(p) for p in program.params])
        for p, g, total in zip(program.params, static["grads"], sums):
            if p.grad is None:
                p.grad = total.copy_(g)  # a copy's gradient: upcast, exactly
            else:
                p.grad.add_(g)
    # The loss too is the graph's own buffer: a later micro-batch's replay would rewrite it
    # under the step's sum (found on an H100: every logged loss after the capture was wrong).
    return static["loss"] if program.micro_batches == 1 else static["loss"].clone()


class CapturedStep:
    """Callable like GraphProgram.step; the first WARMUP_STEPS steps run eagerly on a side
    stream (lazy cuBLAS / NCCL initialization must not happen during capture), and so does
    every step while the program's kernels are still compiling (runtime/kernels/background.py):
    the step that takes them in is the warm-up of the capture that follows."""

    def __init__(self, program):
        self.program = program
        self.warmup_left = WARMUP_STEPS
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, object] = {}
        self.side: torch.cuda.Stream | None = None

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.warmup_left > 0 or self.program.kernels_pending:
            self.warmup_left = max(0, self.warmup_left - 1)
            self.side = self.side or torch.cuda.Stream()
            loss = on_side_stream(self.program.step, tokens, labels, side=self.side)
            if self.warmup_left == 0 and not self.program.kernels_pending:
                torch.cuda.synchronize()
                # Give the warm-up's blocks back before the graph takes its own pool, so the
                # two do not add up in reserved memory.
                torch.cuda.empty_cache()
            return loss
        if self.graph is None:
            self.static["tokens"], self.static["labels"] = tokens.clone(), labels.clone()
            self.graph = torch.cuda.CUDAGraph()
            with rank_phases()("capturing forward and backward in a CUDA graph", short="capture"), \
                    torch.cuda.graph(self.graph):
                loss, grads = self.program.forward_backward(self.static["tokens"], self.static["labels"])
            self.static["loss"], self.static["grads"] = loss, grads
        else:
            self.static["tokens"].copy_(tokens)
            self.static["labels"].copy_(labels)
        self.graph.replay()
        return hand_out_gradients(self.program, self.static)

    def close(self) -> None:
        """Release the graph before the process group goes: a captured graph holds NCCL
        resources, and destroying the communicator under it hangs at exit."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.program.drop_gradients()
            self.static.clear()
            self.graph.reset()
            self.graph = None


class CapturedLoss:
    """A loss-only program (runtime/loss_only.py: validation) captured once and replayed for
    every held-out batch. Callable like GraphProgram.forward_loss; the first call runs eagerly
    on a side stream, as CapturedStep's warm-up does."""

    def __init__(self, forward_loss):
        self.forward_loss = forward_loss
        self.warm = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, torch.Tensor] = {}

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.warm:
            self.warm = True
            return on_side_stream(self.forward_loss, tokens, labels)
        if self.graph is None:
            self.static["tokens"], self.static["labels"] = tokens.clone(), labels.clone()
            self.graph = torch.cuda.CUDAGraph()
            with rank_phases()("capturing the validation forward in a CUDA graph", short="validation capture"), \
                    torch.cuda.graph(self.graph):
                self.static["loss"] = self.forward_loss(self.static["tokens"], self.static["labels"])
        else:
            self.static["tokens"].copy_(tokens)
            self.static["labels"].copy_(labels)
        self.graph.replay()
        return self.static["loss"].clone()  # the next batch's replay rewrites the graph's own buffer

    def close(self) -> None:
        if self.graph is not None:
            torch.cuda.synchronize()
            self.static.clear()
            self.graph.reset()
            self.graph = None

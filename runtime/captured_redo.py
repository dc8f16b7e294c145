"""A bounded MoE dispatch's micro-batch (runtime/moe_redo.py) under CUDA graphs: three captures
and the host's decision between them.

    forward    the bounded forward and its overflow count (a device scalar)
    backward   the bounded backward, then the buffers' new values
    dropless   the dropless forward and backward, then the buffers' new values; its loss and
               gradients are copied into the ones `backward` leaves

Each micro-batch replays `forward`, reads the count (its one host read, as eager), then replays
`backward` when the count is 0 and `dropless` otherwise. The three read the same static inputs
(parameters, buffers, the token and label buffers) and leave the loss and the gradients in the
same tensors, so the optimizer (and its captured update, which reads the gradients where they
were at its capture) sees one set of .grad buffers whichever branch ran. They run the graphs
GraphProgram.forward_backward runs eagerly, in the same order: bitwise the eager redo.

Memory: the three captures share one pool, in that order. What each may take:
- `backward` takes what `forward` freed (its temporaries), never what `forward` returns (held).
- After `backward` is captured, the bounded forward's saved activations and buffer updates are
  let go (nothing reads them from Python; the graphs keep their addresses), so `dropless` may
  take them, with the temporaries of both: on an overflow the bounded attempt is dead once the
  count is read. It never takes the loss, the gradients or the count (held).
- The next micro-batch's `forward` may write over `backward`'s gradients (they may sit in its
  temporaries): they are summed (hand_out_gradients) or read by the optimizer before that replay.
So the pool is about the larger of (bounded forward + backward, dropless step), not their sum:
a redo can come at any step, so its memory is reserved from the start, and under CUDA graphs
the capacity buys the common step's time, not peak memory (building with --ac full makes the
dropless step recompute instead of storing its activations). Two separate pools would reserve
both programs at once; capturing the dropless step on the first overflow would stall that step
for a capture.
"""

from __future__ import annotations

import torch

from titan.runtime.cudagraph import WARMUP_STEPS, hand_out_gradients, on_side_stream
from titan.runtime.startup import rank_phases


class SharedPoolGraphs:
    """CUDA graphs captured one after another into one memory pool. A capture may take memory an
    earlier one freed or let go, so they must replay in capture order, skipping a branch at most
    (see the module's docstring for why that holds here)."""

    def __init__(self):
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def eagerly(self, work, *args):
        """A warm-up run (lazy cuBLAS / NCCL set-up must not happen during a capture)."""
        return on_side_stream(work, *args)

    def settle(self) -> None:
        """Waits for the device and gives the cached blocks back (after the warm-up: before the
        pool takes its own)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def capture(self, work, *args):
        """`work(*args)` captured (recorded, not run); returns (replay, what work returned)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graphs[0].pool() if self.graphs else None):
            result = work(*args)
        self.graphs.append(graph)
        return graph.replay, result

    def close(self) -> None:
        if self.graphs:
            torch.cuda.synchronize()
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()


class CapturedRedoStep:
    """Callable like GraphProgram.step for a program with an overflow redo. The first
    WARMUP_STEPS micro-batches run eagerly (GraphProgram.step); the last of them also rehearses
    the branch it did not take, so each program has run once before its capture. `graphs`: how
    the pieces are captured and replayed (SharedPoolGraphs on a GPU)."""

    def __init__(self, program, *, graphs=None):
        assert program.redo is not None
        self.program = program
        self.graphs = graphs if graphs is not None else SharedPoolGraphs()
        self.warmup_left = WARMUP_STEPS
        self.replay: dict[str, object] = {}
        self.static: dict[str, object] = {}

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.warmup_left > 0:
            self.warmup_left -= 1
            loss = self.graphs.eagerly(self.program.step, tokens, labels)
            if self.warmup_left == 0:
                self.graphs.eagerly(rehearse, self.program, tokens, labels)
                self.graphs.settle()
            return loss
        if not self.replay:
            self.static["tokens"], self.static["labels"] = tokens.clone(), labels.clone()
            with rank_phases()("capturing the bounded forward, its backward and the dropless step in CUDA graphs",
                               short="capture"):
                self._capture()
        else:
            self.static["tokens"].copy_(tokens)
            self.static["labels"].copy_(labels)
        self.replay["forward"]()
        self.replay["dropless" if self.program.redo.overflowed(self.static["overflow"]) else "backward"]()
        return hand_out_gradients(self.program, self.static)

    def _capture(self) -> None:
        program, static = self.program, self.static
        args = program.forward_args(static["tokens"], static["labels"])
        self.replay["forward"], (outputs, static["overflow"]) = self.graphs.capture(bounded_forward, program, args)
        self.replay["backward"], (static["loss"], static["grads"]) = self.graphs.capture(
            program.finish, outputs, program.backward)
        del outputs  # the bounded attempt's saved activations: the dropless step may reuse their memory
        self.replay["dropless"], _ = self.graphs.capture(dropless_step, program, args, static)

    def close(self) -> None:
        """Release the graphs before the process group goes (see CapturedStep.close)."""
        if self.replay:
            self.graphs.settle()  # the last replays end before their tensors go
            self.program.drop_gradients()
            self.static.clear()
            self.replay.clear()
            self.graphs.close()


@torch.no_grad()
def bounded_forward(program, args: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The bounded forward's outputs and its overflow count."""
    outputs = list(program.forward(*args))
    return outputs, program.redo.overflow_count(outputs)


@torch.no_grad()
def dropless_step(program, args: list[torch.Tensor], static: dict) -> None:
    """The dropless forward + backward (buffers updated), its loss and gradients left where the
    bounded backward leaves its own."""
    loss, grads = program.finish(program.redo.forward(*args), program.redo.backward)
    static["loss"].copy_(loss)
    for into, g in zip(static["grads"], grads):
        if into is not None:  # a parameter the loss does not reach has none, in both programs
            into.copy_(g)


@torch.no_grad()
def rehearse(program, tokens: torch.Tensor, labels: torch.Tensor) -> None:
    """The bounded and the dropless forward and backward once each, with nothing applied (no
    buffer update, no gradient kept): whichever branch the warm-up step took, every kernel and
    collective of the three captures has run once. Every rank rehearses alike."""
    args = program.forward_args(tokens, labels)
    n_updates = len(program.buffers.mutated)
    for forward, backward in ((program.forward, program.backward), (program.redo.forward, program.redo.backward)):
        outputs = forward(*args)
        backward(*outputs[n_updates + 1:], torch.ones_like(outputs[n_updates]))
        del outputs

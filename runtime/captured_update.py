"""A rank's optimizer update on a GPU (the global gradient norm, the clip, the one-kernel AdamW)
captured once in a CUDA graph and replayed every step, beside the forward + backward graph
(runtime/cudagraph.py).

What changes from step to step reaches the graph as data: the learning rate and the bias
corrections are copied into a device buffer the captured kernels read (FusedAdamW.prepare), and
the clip coefficient never leaves the device (the AdamW kernel multiplies each gradient by it as
it reads it, rounding as the separate multiplication would). The host's work per step is that
copy and one replay, whatever the number of parameters.

The captured kernels read the gradients where they were at capture: the forward + backward
graph's own buffers, which stay in place. A gradient found elsewhere (a new buffer) means a new
capture, never a stale read.
"""

from __future__ import annotations

import torch

from titan.runtime.fused_adamw import FusedAdamW
from titan.runtime.grad_clip import GlobalNormClip
from titan.runtime.param_copies import gradients
from titan.runtime.startup import rank_phases


class CapturedUpdate:
    """Callable: applies the step's update and returns the global gradient norm (a device
    scalar). The first call runs eagerly (the kernel's compilation and the collectives' lazy
    set-up must not happen during a capture); the second captures. `eager_while()`: true while
    the forward + backward is not captured yet either (its kernels still compiling:
    runtime/kernels/background.py): its gradients are new buffers at every step, which would
    mean a capture at every step."""

    def __init__(self, clip: GlobalNormClip, optimizer: FusedAdamW, *, eager_while=lambda: False):
        self.clip, self.optimizer, self.eager_while = clip, optimizer, eager_while
        self.eager_left = 1
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured_at: list[int] = []
        self.norm: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        grads = gradients(self.optimizer.params, self.optimizer.copies)
        self.optimizer.prepare()
        if self.eager_left > 0 or self.eager_while():
            self.eager_left = max(0, self.eager_left - 1)
            return clipped_update(self.clip, self.optimizer, grads)
        where = [g.data_ptr() for g in grads]
        if self.graph is None or where != self.captured_at:
            self.close()
            self.graph, self.captured_at = torch.cuda.CUDAGraph(), where
            with rank_phases()("capturing the optimizer step in a CUDA graph", short="update capture"), \
                    torch.cuda.graph(self.graph):
                self.norm = clipped_update(self.clip, self.optimizer, grads)
        self.graph.replay()  # a capture records without running: the replay is the step
        return self.norm

    def close(self) -> None:
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph, self.norm = None, None


def clipped_update(clip: GlobalNormClip, optimizer: FusedAdamW, grads: list[torch.Tensor]) -> torch.Tensor:
    """The global norm of `grads`, the clip and the one-kernel AdamW update (device work only, so
    a capture can record it); returns the norm before the clip. The kernel multiplies each
    gradient (upcast first where it is a copy's) by the clip coefficient as it reads it."""
    norm, coef = clip.norm_and_coef(grads)
    optimizer.launch(coef)
    return norm

"""What rank 0 reports after every step: a progress bar on a terminal or one plain line per
step, the --metrics JSON lines, and TensorBoard scalars (--tensorboard).

Per-step record (a --metrics line): step, loss (global mean), tokens_per_s, step_time_s, time
(unix seconds) and, on GPU, peak_mem_gib. TensorBoard gets the same values as float64 scalars
under the same names, at global step `step`, so they read back exactly.

torch.utils.tensorboard is imported only when --tensorboard is given; it imports neither
torch._dynamo nor torch._inductor (tests/test_runtime_minimal.py checks it).
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from titan.runtime.progress import StatusLine, bar, duration, is_terminal

TENSORBOARD_HINT = "pip install 'titan-aot[watch]' (or: pip install tensorboard)"
SCALARS = ("loss", "tokens_per_s", "step_time_s", "peak_mem_gib")


def open_tensorboard(log_dir: str):
    """A SummaryWriter for `log_dir`; ValueError naming the install command when tensorboard
    is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}") from None
    return SummaryWriter(log_dir)


class StepLog:
    """Rank 0's per-step reporter; call it with each step's record."""

    def __init__(self, *, total: int, metrics: str | None, tensorboard: str | None, show: bool,
                 stream: TextIO = sys.stdout, append: bool = False):
        self.total = total
        self.stream = stream
        self.show = show
        self.status = StatusLine(stream) if show and is_terminal(stream) else None
        # A resumed run continues the metrics file of the run it resumes.
        self.metrics = open(metrics, "a" if append else "w", buffering=1) if metrics else None
        self.writer = open_tensorboard(tensorboard) if tensorboard else None
        self.first_done: float | None = None
        self.first_step = 0

    def __call__(self, rec: dict) -> None:
        if self.status is not None:
            self.status.update(self.bar_line(rec))
            if rec["step"] == self.total:
                self.status.finish()
        elif self.show:
            print(f"step {rec['step']:>4}/{self.total} | loss {rec['loss']:.6f} | tokens/s {rec['tokens_per_s']:,.0f}"
                  f" | step {rec['step_time_s']:.3f} s", file=self.stream, flush=True)
        if self.metrics is not None:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()
        if self.writer is not None:
            for name in SCALARS:
                if name in rec:
                    self.writer.add_scalar(name, rec[name], rec["step"], walltime=rec.get("time"),
                                           new_style=True, double_precision=True)
            self.writer.flush()
            if rec["step"] == self.total:
                self.writer.close()

    def bar_line(self, rec: dict) -> str:
        step, now = rec["step"], time.monotonic()
        # The first step carries the warm-up (CUDA graph capture): the ETA uses the steps after it.
        if self.first_done is None:
            self.first_done, self.first_step = now, step
            per_step = rec["step_time_s"]
        else:
            per_step = (now - self.first_done) / (step - self.first_step)
        eta = duration(per_step * (self.total - step))
        mem = f" | {rec['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in rec else ""
        return (f"step {step}/{self.total} {bar(step, self.total)} | loss {rec['loss']:.4f} | "
                f"{rec['tokens_per_s']:,.0f} tok/s{mem} | ETA {eta}")

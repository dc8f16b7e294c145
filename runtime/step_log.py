"""What rank 0 reports after every step: a progress bar on a terminal or one plain line per
step, the --metrics JSON lines, and TensorBoard scalars (--tensorboard).

A --metrics file starts with a header line, {"config": the run's effective RunConfig}, written
once by the run that creates the file. Per-step record (a --metrics line): step, loss (global
mean), lr (the step's learning rate), grad_norm (the global gradient norm before clipping),
tokens_per_s, step_time_s, time (unix seconds), on GPU peak_mem_gib and, for a mixture of experts, expert_load_max,
expert_load_mean (tokens per expert) and dropped_tokens (runtime/buffer_state.py); with a bounded
dispatch that stays dropless (titan-build --moe-capacity), moe_redone (the step's micro-batches
redone by the dropless program) and moe_overflow (the assignments their bounded attempts could
not hold: runtime/moe_redo.py). TensorBoard gets the same values as float64 scalars
under the same names, at global step `step`, so they read back exactly.

torch.utils.tensorboard is imported only when --tensorboard is given; it imports neither
torch._dynamo nor torch._inductor (tests/e2e/test_runtime_minimal.py checks it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

import titan.runtime.common.interrupt as interrupt
from titan.runtime.metrics_file import MAX_METRICS_BYTES
from titan.runtime.common.progress import StatusLine, bar, duration, is_terminal
from titan.runtime.common.safe_files import UnsafeFile, read_user_file, replace_file

TENSORBOARD_HINT = "pip install -e '.[watch]' from a clone (or: pip install tensorboard)"
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_gib", "expert_load_max", "expert_load_mean",
           "dropped_tokens", "moe_redone", "moe_overflow")


def open_tensorboard(log_dir: str):
    """A SummaryWriter for `log_dir`; ValueError naming the install command when tensorboard
    is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}") from None
    return SummaryWriter(log_dir)


def keep_steps_through(path: str, step: int) -> None:
    """Cut a metrics file back to the records of steps 1..`step` (a resumed run rewrites the
    steps after its checkpoint, so the file ends as an uninterrupted run's would); replaced by
    rename, so an interrupt leaves the old file or the new one."""
    path = Path(path)
    try:
        text = read_user_file(path, max_size=MAX_METRICS_BYTES, what=f"--metrics {path}")
    except UnsafeFile as e:
        if "is missing" in str(e):
            return
        raise ValueError(f"{e}; give --metrics a regular file") from None
    lines = text.decode(errors="replace").splitlines()
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(rec, dict) and ("config" in rec or isinstance(rec.get("step"), int) and rec["step"] <= step):
            kept.append(line + "\n")
    with interrupt.deferred():
        replace_file(path, "".join(kept).encode())


class StepLog:
    """Rank 0's per-step reporter; call it with each step's record."""

    def __init__(self, *, total: int, metrics: str | None, tensorboard: str | None, show: bool,
                 stream: TextIO = sys.stdout, resume_after: int | None = None, config: dict | None = None):
        """`config`: the run's configuration, the header line of a new metrics file."""
        self.total = total
        self.stream = stream
        self.show = show
        self.status = StatusLine(stream) if show and is_terminal(stream) else None
        if metrics and resume_after is not None:
            keep_steps_through(metrics, resume_after)
        self.metrics = open(metrics, "a", buffering=1) if metrics else None
        if self.metrics is not None and config is not None and self.metrics.tell() == 0:
            self.metrics.write(json.dumps({"config": config}) + "\n")
        self.writer = open_tensorboard(tensorboard) if tensorboard else None
        self.first_done: float | None = None
        self.first_step = 0

    def note(self, text: str) -> None:
        """A line between the step lines (above the progress bar on a terminal)."""
        if self.status is not None:
            self.status.print_above(text)
        elif self.show:
            print(text, file=self.stream, flush=True)

    def __call__(self, rec: dict) -> None:
        if self.status is not None:
            self.status.update(self.bar_line(rec))
            if rec["step"] == self.total:
                self.status.finish()
        elif self.show:
            print(f"step {rec['step']:>4}/{self.total} | loss {rec['loss']:.6f} | tokens/s {rec['tokens_per_s']:,.0f}"
                  f" | step {rec['step_time_s']:.3f} s", file=self.stream, flush=True)
        if self.metrics is not None:
            with interrupt.deferred():  # whole lines only
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

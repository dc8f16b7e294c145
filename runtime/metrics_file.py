"""Reading a titan-run --metrics file (written by step_log.py): a header line with the run's
config, then one JSON object per step, with step, loss, lr, grad_norm, tokens_per_s,
step_time_s, time and, on GPU, peak_mem_gib."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

REQUIRED = ("step", "loss", "tokens_per_s", "step_time_s")
MAX_METRICS_BYTES = 1 << 30
"""A million steps of metrics are ~150 MB."""


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file; ValueError naming the line for anything else."""
    from titan.runtime.safe_files import check_depth, read_user_file

    path = Path(path)
    records = []
    # A regular file of bounded size (a FIFO or /dev/zero is refused, not read forever).
    text = read_user_file(path, max_size=MAX_METRICS_BYTES, what=f"metrics file {path}").decode(errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            check_depth(rec, 8, f"{path}: line {number}")
        except (ValueError, RecursionError):
            raise ValueError(f"{path}: line {number} is not JSON; is this a titan-run --metrics file?") from None
        if isinstance(rec, dict) and "config" in rec and "step" not in rec:
            continue  # the header: the run's configuration
        missing = [k for k in REQUIRED if not isinstance(rec, dict) or not isinstance(rec.get(k), (int, float))]
        if missing:
            raise ValueError(f"{path}: line {number} lacks {', '.join(missing)} (numbers); "
                             "is this a titan-run --metrics file?")
        records.append(rec)
    if not records:
        raise ValueError(f"{path} holds no steps; point titan-report at the file a run wrote with --metrics")
    return records


def summary(records: list[dict]) -> list[str]:
    """A few lines of text: steps, first / last / lowest loss, median throughput and step time,
    peak memory when recorded."""
    losses = [r["loss"] for r in records]
    finite = [(loss, r["step"]) for loss, r in zip(losses, records) if math.isfinite(loss)]
    lines = [f"steps        {records[0]['step']}-{records[-1]['step']} ({len(records)} records)",
             f"loss         first {losses[0]:.6f}, last {losses[-1]:.6f}"
             + (f", min {min(finite)[0]:.6f} (step {min(finite)[1]})" if finite else ""),
             f"tokens/s     median {statistics.median(r['tokens_per_s'] for r in records):,.0f}",
             f"step time    median {statistics.median(r['step_time_s'] for r in records):.4f} s"]
    mem = [r["peak_mem_gib"] for r in records if "peak_mem_gib" in r]
    if mem:
        lines.append(f"peak memory  max {max(mem):.2f} GiB")
    return lines

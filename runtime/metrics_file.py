"""Reading a titan-run --metrics file (written by step_log.py): a header line with the run's
config, then one JSON object per step, with step, loss, lr, grad_norm, tokens_per_s,
step_time_s, time and, on GPU, peak_mem_gib; a mixture of experts adds its expert load and
dropped_tokens, and a bounded dispatch that stays dropless moe_redone and moe_overflow (the
field list: runtime/step_log.py)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

REQUIRED = ("step", "loss", "tokens_per_s", "step_time_s")
MAX_STEP = 1 << 53
"""Steps are integers a float holds exactly (what the plot's axis takes)."""
MAX_METRICS_BYTES = 1 << 30
"""A million steps of metrics are ~150 MB."""


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file; ValueError naming the line for anything else."""
    from titan.runtime.common.safe_files import check_depth, read_user_file

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
        records.append(_checked(rec, f"{path}: line {number}"))
    if not records:
        raise ValueError(f"{path} holds no steps; point titan-report at the file a run wrote with --metrics")
    return records


def _checked(rec, where: str) -> dict:
    """A step's record with every value titan-report uses checked: `step` an integer in
    [0, 2^53], `loss` a number (NaN or infinite: a diverged run), throughput and times finite
    numbers >= 0, `peak_mem_gib` (if present) too. Values become floats here, once."""
    hint = "is this a titan-run --metrics file?"
    missing = [k for k in REQUIRED if not isinstance(rec, dict) or k not in rec]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)} (numbers); {hint}")

    def number(key: str, *, finite: bool) -> float:
        v = rec[key]
        try:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError
            x = float(v)  # an integer of 400 digits does not fit: OverflowError
        except (TypeError, OverflowError):
            raise ValueError(f"{where}: {key} is {str(v)[:40]!r}, not a number; {hint}") from None
        if finite and not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{where}: {key} is {x}, not a finite number >= 0; {hint}")
        return x

    step = rec["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"{where}: step {str(step)[:40]!r} is not an integer in [0, 2^53]; {hint}")
    out = dict(rec, loss=number("loss", finite=False), tokens_per_s=number("tokens_per_s", finite=True),
               step_time_s=number("step_time_s", finite=True))
    if "peak_mem_gib" in rec:
        out["peak_mem_gib"] = number("peak_mem_gib", finite=True)
    return out


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

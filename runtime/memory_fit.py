"""Whether a job fits the memory of the machine it starts on: an estimate made before any rank
starts (titan-run, titan-verify), so that a job that cannot fit says so in a second instead of
swapping or failing minutes later.

The estimate is a lower bound: each rank's parameters, gradients and the two AdamW moments
(4 copies of its parameter shards) plus the activations its forward saves for the backward
(the build recorded their bytes). Temporaries come on top, so only a bound that already
exceeds the memory is refused; one above what is free now is a warning.

Standard library only (no torch): titan-run checks this before it imports torch.
"""

from __future__ import annotations

import math
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan.runtime.contract.rank_record import RankRecord

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
GiB = 2**30


def rank_bytes(record: RankRecord) -> int:
    """A lower bound of one rank's memory in training: parameter shards, their gradients and
    AdamW's two moments, and the saved activations."""
    params = sum(math.prod(p.local_shape) * BYTES.get(p.dtype, 4) for p in record.params)
    return 4 * params + record.saved_bytes


def host_memory() -> tuple[int, int] | None:
    """(total, available) bytes of this host's memory, from /proc/meminfo; None elsewhere."""
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields:
        return None
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])


def gpu_memory() -> list[int] | None:
    """Total bytes of each GPU nvidia-smi lists (in its order; None if there is none or no
    nvidia-smi). Asked of nvidia-smi, not torch: this process must not take a CUDA context that
    it would hold on GPU 0 for the whole job."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    try:
        return [int(float(line)) * 2**20 for line in out.stdout.split()] or None
    except ValueError:
        return None


def check_fits(records: list[RankRecord], *, gpu: bool) -> str | None:
    """Raise ValueError when the ranks' lower bound exceeds this host's memory (all ranks on
    the host's memory on CPU; each rank on its own GPU on GPU); return a warning when it only
    exceeds what is free now (CPU), else None."""
    need = [rank_bytes(r) for r in records]
    if gpu:
        gpus = gpu_memory()
        if gpus and max(need) > min(gpus):
            raise ValueError(f"each rank needs at least {max(need) / GiB:.1f} GiB (parameters, gradients, AdamW state "
                             f"and saved activations) but a GPU here has {min(gpus) / GiB:.1f} GiB; rebuild the artifact with more "
                             "--tp or --dp-shard ranks, a smaller batch, or --ac full")
        return None
    memory = host_memory()
    if memory is None:
        return None
    total, available = memory
    if sum(need) > total:
        raise ValueError(f"the {len(need)} rank(s) need at least {sum(need) / GiB:.1f} GiB (parameters, gradients, "
                         f"AdamW state and saved activations) but this host has {total / GiB:.1f} GiB, which its ranks share; "
                         "build a smaller model (e.g. --flavor debug) or batch, or run it on GPUs")
    if sum(need) > available:
        return (f"the {len(need)} rank(s) need at least {sum(need) / GiB:.1f} GiB and {available / GiB:.1f} GiB is free "
                "now: the run may swap or be killed")
    return None

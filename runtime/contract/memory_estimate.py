"""What a rank of a program needs in memory at least, and whether the device (or, for CPU
ranks, the host) can hold it: checked before any rank starts and before the first step, so that
a run that cannot fit ends with one line that says what to change, not with an out-of-memory
kill minutes in (or a host brought down by a crafted artifact's world size).

The estimate is a lower bound, from the program's metadata and its graphs' recorded shapes:
the fp32 parameters and AdamW's two moments (alive from the first step on), the buffers, and
the larger of the saved activations (all alive at the end of the forward) and the largest
single result of either graph, plus the dense FlexAttention kernel's workspace where a graph
calls it on the CPU (its (batch, heads, seq, seq) float32 scores and the boolean mask: the mask
of an artifact built with --attention flex is made inside that kernel, issue 31; on a GPU the
fused kernels hold none). Gradients and other
transients come on top, so a program over
the bound cannot run, and one under it may still not: it never refuses a run that fits.
No torch import at module level (titan-run's launcher checks before it imports torch)."""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.fx as fx

    from titan.runtime.contract.rank_record import RankRecord

GIB = 1 << 30
PARAM_STATE_BYTES = 16
"""Per parameter element: the fp32 parameter, its gradient and AdamW's two moments (what
titan-build reports as params/grads/AdamW)."""
PARAM_LIVE_BYTES = 12
"""Per parameter element, alive through the whole step: parameter and the two moments."""
RANK_PROCESS_BYTES = int(0.4 * GIB)
"""A CPU rank's process before its program: Python, torch, gloo (a debug rank peaks at 0.30 GiB)."""
MAX_CPU_RANKS_PER_CORE = 8
"""CPU ranks per core a host may run: gloo ranks wait in collectives, so a few per core work
(the tests run 8 on 2 cores); thousands would only thrash."""
_DTYPE_BYTES = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2,
                "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one rank of a program holds at least."""
    param_elements: int
    """Elements of this rank's parameter shards."""
    buffers: int
    """The model's buffers (fp32 / int64)."""
    activations: int
    """The larger of the saved activations and the largest single graph result."""
    attention_workspace: int = 0
    """The dense FlexAttention kernel's scores and mask at its largest call (0: no flex attention)."""
    param_copies: int = 0
    """The compute-dtype copies of parameters the forward takes instead (runtime/param_copies.py)."""

    @property
    def param_state(self) -> int:
        return self.param_elements * PARAM_STATE_BYTES

    @property
    def at_least(self) -> int:
        return self._param_live + self.buffers + self.activations + self.attention_workspace

    @property
    def _param_live(self) -> int:
        return self.param_elements * PARAM_LIVE_BYTES + self.param_copies

    def describe(self) -> str:
        return (f"at least {self.at_least / GIB:.2f} GiB per rank (parameters and AdamW state "
                f"{self._param_live / GIB:.2f} GiB, activations {self.activations / GIB:.2f} GiB"
                + (f", flex attention scores and mask {self.attention_workspace / GIB:.2f} GiB"
                   if self.attention_workspace else "") + ")")


_FLEX_SCORE_TENSORS = {"titan.flex_attention.default": (0, 2), "titan.flex_attention_backward.default": (1, 3)}
"""Flex op -> (position of q among its arguments, float32 (batch, heads, seq, seq) tensors its
dense kernel holds at once: scores and probabilities; probabilities, their gradient and the
scores' gradient)."""


def flex_attention_workspace(graphs) -> int:
    """Bytes the dense FlexAttention kernel (runtime/contract/flex_attention.py) holds at its
    largest call in `graphs`: its score-sized float32 tensors and the (batch, seq, seq) mask."""
    largest = 0
    for g in graphs:
        for n in g.graph.nodes:
            found = _FLEX_SCORE_TENSORS.get(str(n.target)) if n.op == "call_function" else None
            q_val = found and n.args[found[0]].meta.get("titan_val")
            if not (isinstance(q_val, dict) and isinstance(q_val.get("shape"), list) and len(q_val["shape"]) == 4):
                continue
            b, h, s, _ = q_val["shape"]
            largest = max(largest, found[1] * b * h * s * s * 4 + b * s * s)
    return largest


def param_elements(record: RankRecord) -> int:
    return sum(math.prod(p.local_shape) for p in record.params)


def param_copy_bytes(record: RankRecord) -> int:
    """Bytes of the parameters' compute-dtype copies (GraphInput.cast)."""
    casts = (i.cast for i in record.forward_inputs if i.kind == "param")
    return sum(math.prod(p.local_shape) * _DTYPE_BYTES[cast] for p, cast in zip(record.params, casts) if cast)


def _buffer_bytes(record: RankRecord) -> int:
    return sum(math.prod(b.shape) * _DTYPE_BYTES.get(b.dtype, 8) for b in record.buffers)


def estimate_from_record(record: RankRecord) -> MemoryEstimate:
    """From the program's metadata alone (its saved-activation bytes as titan-build measured
    them): what titan-run's launcher checks before any rank starts."""
    return MemoryEstimate(param_elements=param_elements(record), buffers=_buffer_bytes(record),
                          activations=record.saved_bytes, param_copies=param_copy_bytes(record))


def val_bytes(val) -> int:
    """Bytes of a node's recorded result (graph_decode.py bounds its shape)."""
    if isinstance(val, list):
        return sum(val_bytes(v) for v in val)
    if isinstance(val, dict) and isinstance(val.get("shape"), list):
        return math.prod(val["shape"]) * _DTYPE_BYTES.get(val.get("dtype"), 8)
    return 0


def estimate_from_graphs(record: RankRecord, forward: fx.GraphModule, backward: fx.GraphModule, *,
                         dense_flex: bool = True) -> MemoryEstimate:
    """From the graphs this rank loaded: the saved activations are the forward's results after
    the buffer updates and the loss, and no result of either graph is smaller than itself.
    `dense_flex`: whether the flex op runs its dense kernel (the CPU's; on a GPU its fused kernels
    hold no score-sized workspace: runtime/kernels/flex_kernels.py)."""
    fw_out = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    # A parameter (or its copy) or buffer the forward saves as it took it is state, counted
    # once, as titan-build's saved bytes count it.
    state = {n for n, inp in zip((n for n in forward.graph.nodes if n.op == "placeholder"), record.forward_inputs)
             if inp.kind in ("param", "buffer")}
    saved = sum(val_bytes(n.meta.get("titan_val")) for n in fw_out[len(record.mutated_buffers) + 1:]
                if n is not None and n not in state)
    largest = max((val_bytes(n.meta.get("titan_val")) for g in (forward, backward) for n in g.graph.nodes
                   if n.op == "call_function"), default=0)
    return MemoryEstimate(param_elements=param_elements(record), buffers=_buffer_bytes(record),
                          activations=max(saved, largest), param_copies=param_copy_bytes(record),
                          attention_workspace=flex_attention_workspace((forward, backward)) if dense_flex else 0)


def capacity_saving(bounded: RankRecord, dropless: RankRecord) -> str:
    """What a bounded MoE dispatch (titan-build --moe-capacity) saves one rank: its program's
    saved activations against the dropless program's, which it carries to redo an overflowing
    step (that program's memory is needed only on such a step, while it runs)."""
    plan, worst = bounded.model_plan or {}, dropless.model_plan or {}
    rows = (f"{plan['buffer_rows']:,} dispatch rows per buffer instead of {worst['buffer_rows']:,}; "
            if "buffer_rows" in plan and "buffer_rows" in worst else "")
    saved = dropless.saved_bytes - bounded.saved_bytes
    return (f"MoE capacity {plan.get('capacity_factor', '?')}: {rows}saved activations "
            f"{_size(bounded.saved_bytes)} instead of {_size(dropless.saved_bytes)} per rank "
            f"({_size(saved)} less; the dropless redo program needs its own on an overflowing step)")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.2f} MiB"


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


def check_fits(records: list[RankRecord], *, gpu: bool, name: str) -> str | None:
    """Before any rank starts: raise ValueError (one line, with the fix) when the ranks cannot
    run here: on CPU more than MAX_CPU_RANKS_PER_CORE per core, or a lower bound of their memory
    (each a process of RANK_PROCESS_BYTES plus estimate_from_record) over the host's, which they
    share; on GPU one rank's over a GPU's. Returns a warning when the CPU ranks only exceed what
    is free now, else None. No torch: titan-run checks this before it imports torch."""
    need = [estimate_from_record(r).at_least for r in records]
    if gpu:
        gpus = gpu_memory()
        if gpus and max(need) > min(gpus):
            raise ValueError(f"each rank needs at least {max(need) / GIB:.1f} GiB (parameters, gradients, AdamW state "
                             f"and saved activations) but a GPU here has {min(gpus) / GIB:.1f} GiB; rebuild the artifact "
                             "with more --tp or --dp-shard ranks, a smaller batch, or --ac full")
        return None
    cores = os.cpu_count() or 1
    if len(records) > MAX_CPU_RANKS_PER_CORE * cores:
        raise ValueError(f"{name} has {len(records):,} ranks, more than this host's {cores} core(s) can run on CPU "
                         f"(at most {MAX_CPU_RANKS_PER_CORE * cores}); run it on GPUs, across hosts with torchrun, "
                         f"or build a layout with fewer ranks")
    memory = host_memory()
    if memory is None:
        return None
    total, available = memory
    cpu_need = sum(need) + len(records) * RANK_PROCESS_BYTES
    if cpu_need > total:
        raise ValueError(f"the {len(records):,} rank(s) need at least {cpu_need / GIB:.1f} GiB ({RANK_PROCESS_BYTES / GIB:.1f} "
                         f"GiB per process, parameters, gradients, AdamW state and saved activations) but this host has "
                         f"{total / GIB:.1f} GiB, which its ranks share; build a smaller model (e.g. --flavor debug), "
                         "layout or batch, or run it on GPUs")
    if cpu_need > available:
        return (f"the {len(records):,} rank(s) need at least {cpu_need / GIB:.1f} GiB and {available / GIB:.1f} GiB is "
                "free now: the run may swap or be killed")
    return None


def check_device(estimate: MemoryEstimate, device: torch.device, *, name: str) -> None:
    """ValueError (one line, with the fix) if one rank's program cannot fit its GPU (total
    memory), or CPU ranks' programs cannot fit the host (each rank counts its local peers)."""
    if device.type == "cuda":
        import torch
        total, what = torch.cuda.get_device_properties(device).total_memory, "this GPU has"
        need = estimate.at_least
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        total, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"the host's {local} rank(s) share"
        need = estimate.at_least * local
    if need > total:
        raise ValueError(f"{name} needs {estimate.describe()}, {need / GIB:.1f} GiB in all, but {what} "
                         f"{total / GIB:.1f} GiB; build it with more ranks (--tp, --dp-shard, --ep), a smaller "
                         f"batch or sequence, or --ac full")

"""Distributed checkpoints (torch.distributed.checkpoint) of parameters and AdamW state.

On disk, `--checkpoint-dir DIR` holds one directory per saved step:

    DIR/step-00000003/shard-0000R-model-00001-of-00001.safetensors   (DCP, one file per writing rank)
    DIR/step-00000003/titan.json                                      (step, layout, model config, ...)

Every local shard is a box of its global tensor (runtime/contract/shards.py `shard_box`), padded where
an FSDP cut does not divide; only the box's real rows are saved and loaded. DCP's plans are
made from those boxes (runtime/dcp_boxes.py), so the checkpoint describes global boxes and loads
into any layout (DCP reads the intersections). Boxes held by several ranks (replicated
parameters) are written once (DCP deduplicates equal boxes). The files are written through DCP's safetensors storage:
the offsets live in JSON safetensors headers, so loading unpickles nothing.

A model's buffers (state the forward updates outside the gradient, runtime/buffer_state.py)
are saved whole under `buffer.<name>`: every rank holds the same values, so DCP writes them once.

Data needs no state of its own (a batch is a pure function of the step), and the training loop
draws no random numbers, so the step is the whole data / RNG position.

A step is written to `.step-N.partial` and renamed into place after every rank finished and
titan.json was written (last): a complete step directory is never modified, and a crash
leaves at most a partial directory: the launcher removes it when a signal stops the job, and
the next save removes any a killed job left.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from titan.runtime.contract.graph_doc import MAX_ELEMENTS
from titan.runtime.checkpoint_dirs import (STATE_FILE, complete_steps, remove_partial_saves,  # noqa: F401
                                          resolve_checkpoint, step_path)
from titan.runtime.contract.rank_record import BufferSpec, ParamSpec
from titan.runtime.contract.shards import shard_box

CHECKPOINT_FORMAT = "titan-checkpoint"
CHECKPOINT_VERSION = 1

MAX_STEP = 1 << 53
"""The largest step counter a checkpoint may hold (an exact float64 integer)."""


def read_state(step_dir: Path) -> dict:
    """The step directory's titan.json, bounded in size and nesting, with every value titan
    reads from it checked (a checkpoint is untrusted input, as an artifact is)."""
    from titan.runtime.common.safe_files import UnsafeFile, read_json

    path = step_dir / STATE_FILE
    try:
        state = read_json(path, what=STATE_FILE)
    except UnsafeFile as e:
        raise ValueError(f"{path} is not readable JSON ({e}); resume from another step directory") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a titan checkpoint description; resume from a --checkpoint-dir "
                         "written by titan-run")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path} has checkpoint version {str(state.get('version'))[:20]!r}; this titan reads "
                         f"version {CHECKPOINT_VERSION}")
    _check_state(state, path)
    return state


def _check_state(state: dict, path: Path) -> None:
    def bad(what: str):
        raise ValueError(f"{path}: {what}; it was not written by titan-run (or was edited): use another checkpoint")

    for key in ("step", "optimizer_steps", "seq_len"):
        v = state.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEP:
            bad(f"{key} {str(v)[:40]!r} is not an integer in [0, 2^53]")
    for key in ("model_config", "hf_config", "settings"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            bad(f"{key} is not a map")
    if not isinstance(state.get("model_config"), dict):
        bad("it has no model_config")
    for key in ("params", "buffers"):
        shapes = state.get(key, {})
        if not isinstance(shapes, dict) or (key == "params" and not shapes):
            bad(f"{key} is not a map of tensor names to shapes")
        for fqn, shape in shapes.items():
            if not _is_shape(shape):
                bad(f"{key} {fqn[:80]!r} has shape {str(shape)[:60]}, not at most 8 dimensions of at most "
                    f"2^34 elements in all")


def _is_shape(shape) -> bool:
    if not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape):
        return False
    total = 1
    for d in shape:
        total *= d
    return total <= MAX_ELEMENTS


def check_matches(state: dict, step_dir: Path, *, model_config: dict, params: tuple[ParamSpec, ...],
                  buffers: tuple[BufferSpec, ...] = ()) -> None:
    """The checkpoint is of the artifact's model: same config, same parameters and global shapes."""
    if state.get("model_config") != model_config:
        theirs = state.get("model_config") or {}
        diff = [f"{k} {theirs.get(k)!r} (artifact: {v!r})" for k, v in model_config.items() if theirs.get(k) != v]
        raise ValueError(f"{step_dir} is a checkpoint of a different model: {', '.join(diff) or 'other fields'}; "
                         "resume with an artifact built for that model, or use another --checkpoint-dir")
    shapes = {p.fqn: list(p.global_shape) for p in params}
    if state.get("params") != shapes or state.get("buffers", {}) != {b.fqn: list(b.shape) for b in buffers}:
        raise ValueError(f"{step_dir} holds other parameters or shapes than the artifact; resume with an "
                         "artifact built for that model, or use another --checkpoint-dir")



def _described_buffers(buffers: dict[str, torch.Tensor] | None, described: tuple[BufferSpec, ...] | None) -> dict:
    shapes = ({k: list(t.shape) for k, t in (buffers or {}).items()} if described is None
              else {b.fqn: list(b.shape) for b in described})
    return {"buffers": shapes} if shapes else {}


def check_complete(step_dir: Path) -> None:
    """Every tensor of the checkpoint is covered by its saved pieces (no shard file is missing)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from titan.runtime.dcp_boxes import check_covered
    try:
        metadata = HuggingFaceStorageReader(str(step_dir)).read_metadata()
    except Exception as e:  # a truncated or foreign file: safetensors raises its own error types
        raise ValueError(f"{step_dir}: a shard file is unreadable ({type(e).__name__}: {e}); resume from "
                         "another checkpoint") from None
    description = read_state(step_dir)
    for fqn, shape in description["params"].items():
        for family in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
            check_covered(metadata, f"{family}.{fqn}", shape, where=str(step_dir))
    for fqn, shape in description.get("buffers", {}).items():
        check_covered(metadata, f"buffer.{fqn}", shape, where=str(step_dir))


def check_fresh(root: str | os.PathLike) -> None:
    """A run that does not resume must not write into another run's checkpoints."""
    if (Path(root) / STATE_FILE).is_file():
        raise ValueError(f"--checkpoint-dir {root} is one step's directory of another run; choose an empty "
                         "--checkpoint-dir")
    steps = complete_steps(root)
    if steps:
        raise ValueError(f"--checkpoint-dir {root} already holds checkpoints (latest step {steps[-1]}); pass "
                         "--resume to continue from it, or choose an empty --checkpoint-dir")


def dcp_state(params: tuple[ParamSpec, ...], tensors: list[torch.Tensor], optimizer,
              buffers: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict]:
    """The DCP state dict over this rank's live tensors (saving reads them, loading fills them)
    and each entry's box in its global tensor. `buffers`: the model's buffers by name (whole
    on every rank)."""
    state, boxes = {}, {}
    for fqn, t in (buffers or {}).items():
        state[f"buffer.{fqn}"] = t
        boxes[f"buffer.{fqn}"] = ([0] * t.dim(), list(t.shape), list(t.shape))
    for meta, p, m, v in zip(params, tensors, optimizer.exp_avg, optimizer.exp_avg_sq):
        fqn = meta.fqn
        box = shard_box(meta.slices, meta.global_shape)
        if box.empty:  # a trailing FSDP part with no real rows: nothing of this tensor to save or load
            continue
        for key, t in ((f"model.{fqn}", p), (f"optim.exp_avg.{fqn}", m), (f"optim.exp_avg_sq.{fqn}", v)):
            # Only the real rows (a view: loading fills the live tensor); padding stays zero.
            state[key] = t[box.local_index()] if box.padded else t
            boxes[key] = (list(box.offsets), list(box.sizes), list(meta.global_shape))
    return state, boxes


def save(root: str | os.PathLike, step: int, *, params: tuple[ParamSpec, ...], tensors: list[torch.Tensor], optimizer,
         description: dict, buffers: dict[str, torch.Tensor] | None = None,
         described: tuple[ParamSpec, ...] | None = None, described_buffers: tuple[BufferSpec, ...] | None = None
         ) -> Path:
    """Collective: every rank calls it. Returns the complete step directory. `params`: this
    rank's; `described`, `described_buffers`: every parameter and buffer of the model, which
    titan.json lists (default `params` and `buffers`: each rank holds a shard of each; a
    pipeline stage's rank holds only its stages')."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    root = Path(root)
    final = step_path(root, step)
    partial = root / f".{final.name}.partial"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        remove_partial_saves(root)  # a crashed or killed save's: never a complete one
        partial.mkdir()
    if dist.is_initialized():
        dist.barrier()
    from titan.runtime.dcp_boxes import BoxSavePlanner
    state, boxes = dcp_state(params, tensors, optimizer, buffers)
    _dcp_call(dcp.save, state, planner=BoxSavePlanner(boxes),
              storage_writer=HuggingFaceStorageWriter(str(partial), save_distributed=True))
    if rank0:
        written = dict(description, format=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION, step=step,
                       optimizer_steps=optimizer.steps,
                       params={p.fqn: list(p.global_shape) for p in (params if described is None else described)},
                       **_described_buffers(buffers, described_buffers),
                       created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with open(partial / STATE_FILE, "w") as f:
            json.dump(written, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, final)
        fd = os.open(root, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if dist.is_initialized():
        dist.barrier()
    return final


def load(step_dir: Path, *, params: tuple[ParamSpec, ...], tensors: list[torch.Tensor], optimizer,
         buffers: dict[str, torch.Tensor] | None = None) -> dict:
    """Collective: fill this rank's parameters and AdamW state from `step_dir`; returns its titan.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from titan.runtime.dcp_boxes import BoxLoadPlanner
    description = read_state(step_dir)
    state, boxes = dcp_state(params, tensors, optimizer, buffers)
    _dcp_call(dcp.load, state, planner=BoxLoadPlanner(boxes, where=str(step_dir)),
              storage_reader=HuggingFaceStorageReader(str(step_dir)))
    optimizer.steps = int(description["optimizer_steps"])
    return description


def load_full(step_dir: Path, *, families: tuple[str, ...] = ("model",),
              float_buffers: frozenset[str] = frozenset()) -> tuple[dict, dict[str, torch.Tensor]]:
    """Single process: the checkpoint's titan.json and its full (global) tensors by fqn, for
    each family ("model", "optim.exp_avg", "optim.exp_avg_sq"; keys "<family>.<fqn>" when
    several are asked for, plain fqns for one), and with one family the float32 buffers named in
    `float_buffers` that the checkpoint holds (a MoE balancing bias, for titan-export)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from titan.runtime.dcp_boxes import BoxLoadPlanner

    description = read_state(step_dir)
    shapes = description.get("params")
    if not isinstance(shapes, dict):
        raise ValueError(f"{step_dir / STATE_FILE} lists no parameters; it was not written by titan-run")
    state = {f"{family}.{fqn}": torch.empty(shape, dtype=torch.float32)
             for family in families for fqn, shape in shapes.items()}
    if len(families) == 1:
        state.update({f"buffer.{fqn}": torch.empty(shape, dtype=torch.float32)
                      for fqn, shape in (description.get("buffers") or {}).items() if fqn in float_buffers})
    boxes = {key: ([0] * t.dim(), list(t.shape), list(t.shape)) for key, t in state.items()}
    _dcp_call(dcp.load, state, planner=BoxLoadPlanner(boxes, where=str(step_dir)),
              storage_reader=HuggingFaceStorageReader(str(step_dir)))
    if len(families) == 1:
        prefixes = (f"{families[0]}.", "buffer.")
        state = {next(key[len(p):] for p in prefixes if key.startswith(p)): t for key, t in state.items()}
    return description, state


def _dcp_call(fn, *args, **kwargs):
    """DCP reports a failure on any rank as CheckpointException (not an Exception subclass) on
    every rank; it is turned into a ValueError naming the first failure (a checkpoint that does
    not fit, a missing file, a full disk), so that it reaches the user as one line."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        if dist.is_initialized():
            return fn(*args, **kwargs)
        with warnings.catch_warnings():  # "assuming the intent is to ... in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            return fn(*args, no_dist=True, **kwargs)
    except CheckpointException as e:
        failures = list(getattr(e, "failures", {}).values())
        first = failures[0] if failures else e
        if isinstance(first, tuple):  # (exception, traceback) in some torch releases
            first = first[0]
        if isinstance(first, ValueError):
            raise ValueError(str(first).splitlines()[0]) from None
        raise ValueError(f"checkpoint {'save' if fn.__name__ == 'save' else 'load'} failed: "
                         f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}") from None

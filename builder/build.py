"""titan-build's pipeline: validate -> cache lookup -> trace the probe ranks (in parallel
processes forked from one that imported the tracer; a model deeper than 6 layers at 3-5 layers
only, builder/deep_program.py) -> one
program with rank bindings (builder/program.py) -> store in the cache -> export the artifact
(builder/export.py).

Nothing on the cache-hit path imports torch, and this process never imports the tracer (the
trace processes do)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from titan.builder import rank_progress
from titan.builder.cache import Cache
from titan.builder.cache_key import build_factors, describe_differences, digest, rank_factors
from titan.builder.checkpointing import AC_POLICIES
from titan.builder.export import export_artifact
from titan.builder.layout import check_layout
from titan.builder.models import model_spec
from titan.builder.models.shape import apply_shape, shape_tags
from titan.builder.models.spec import ModelConfig, ModelSpec
from titan.builder.passes import check_passes, default_passes
from titan.runtime import interrupt
from titan.runtime.artifact import installed_torch_version
from titan.runtime.contract.hf_record import RECORD
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.manifest import ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, Manifest
from titan.runtime.contract.rank_record import RankRecord

# Per-flavor batch shape defaults: small on CPU, Llama-3 pretraining shape otherwise.
DEFAULT_SHAPE = {"debug": (2, 128)}
PARTITIONERS = ("min_cut", "default")
QUIET_TRACKER = "ignore:resource_tracker:UserWarning"
# Tokens per rank and step: 8B's pretraining batch (16 x 8192) is 2^17; 2^22 is far past what
# any device holds, and keeps every graph's element counts realistic.
MAX_TOKENS_PER_RANK = 2**22
# Manifest fields that shape the graphs: an artifact directory is replaced only by a build
# that agrees on all of them (or with --replace).
SHAPING_FIELDS = ("model", "flavor", "layout", "batch_size", "seq_len", "dtype", "ac", "passes")



@dataclass(kw_only=True, frozen=True)
class BuildSpec:
    model: str
    """Model family (builder/models registry)."""
    flavor: str
    """Size within the family."""
    layout: Layout
    """Parallel layout."""
    batch_size: int
    """Sequences per data-parallel rank per step."""
    seq_len: int
    """Tokens per sequence."""
    partitioner: str = "min_cut"
    """Forward/backward partitioner."""
    dtype: str = "float32"
    """Compute dtype (parameters and optimizer state stay float32)."""
    ac: str = "none"
    """Activation checkpointing policy (builder/checkpointing.py)."""
    graph_passes: tuple[str, ...]
    """Passes applied after partitioning, in order (builder/passes.py)."""
    n_layers: int | None = None
    """The flavor with this many layers instead of its own (tests of deep models at debug
    widths); part of the model config, so of the cache key."""
    shape: tuple[tuple[str, int | float], ...] = ()
    """Dimensions set on top of the flavor (field, value), checked by make_spec
    (builder/models/shape.py); part of the model config and of the artifact's name."""

    @property
    def passes(self) -> tuple[str, ...]:
        return (f"partition:{self.partitioner}", *self.graph_passes)

    @property
    def model_spec(self) -> ModelSpec:
        return model_spec(self.model)

    @property
    def cfg(self) -> ModelConfig:
        cfg = replace(self.model_spec.flavors[self.flavor], **dict(self.shape))
        return cfg if self.n_layers is None else replace(cfg, n_layers=self.n_layers)

    @property
    def name(self) -> str:
        """The default artifact directory's name: model, flavor and layout, then each choice that
        shapes the graphs and differs from its default (`llama3-debug-tp2-s256-bf16-ac-full`), so
        that two different builds never share a default directory."""
        flavor = "" if self.flavor == self.model_spec.default_flavor else f"-{self.flavor}"
        return "-".join([f"{self.model}{flavor}", *shape_tags(dict(self.shape)), self.layout.tag(),
                         *non_default_choices(flavor=self.flavor, mesh=self.layout.mesh_shape(),
                                              batch_size=self.batch_size, seq_len=self.seq_len, dtype=self.dtype,
                                              ac=self.ac, passes=self.passes,
                                              exact_fusion=self.model_spec.exact_fusion)])


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16"}


def _default_dtype(flavor: str) -> str:
    # bf16 is the GPU default; the CPU-sized debug flavor defaults to fp32.
    return "float32" if flavor == "debug" else "bfloat16"


def non_default_choices(*, flavor: str, mesh: list, batch_size: int, seq_len: int, dtype: str, ac: str,
                        passes: list[str] | tuple[str, ...], exact_fusion: bool = True) -> list[str]:
    """Short tags for each graph-shaping choice that differs from its default, in a fixed order:
    b4, s256, bf16, ac-full, default-partition, fuse-blocks, passes-<digest of the list>. Names
    artifacts and tells builds apart in `titan-cache ls`. `passes` as in BuildSpec.passes."""
    tags = []
    default_b, default_s = DEFAULT_SHAPE.get(flavor, (1, 8192))
    if batch_size != default_b:
        tags.append(f"b{batch_size}")
    if seq_len != default_s:
        tags.append(f"s{seq_len}")
    if dtype != _default_dtype(flavor):
        tags.append(DTYPE_TAGS.get(dtype, dtype))
    if ac != "none":
        tags.append(f"ac-{ac}")
    partitioner, *graph_passes = passes
    if partitioner != "partition:min_cut":
        tags.append(f"{partitioner.split(':')[-1]}-partition")
    defaults = default_passes({name: size for name, size in mesh}, exact_fusion=exact_fusion)
    fuse = next((p for p in graph_passes if p in ("fuse_regions", "fuse_blocks")), None)
    if fuse is not None:
        tags.append(fuse.replace("_", "-"))
        defaults = tuple(p for p in defaults if p != "fuse_exact") + (fuse,)
    if tuple(graph_passes) != defaults:
        tags.append("passes-" + hashlib.sha256(",".join(graph_passes).encode()).hexdigest()[:8])
    return tags


def make_spec(*, model: str, flavor: str | None, tp: int, dp_shard: int, dp_replicate: int, ep: int = 1,
              batch_size: int | None, seq_len: int | None, partitioner: str = "min_cut",
              dtype: str | None = None, passes: tuple[str, ...] | None = None, ac: str = "none",
              fuse: str | None = None, shape: Mapping[str, Any] | None = None) -> BuildSpec:
    """Validate user input into a BuildSpec; ValueError names what is wrong and how to fix it.
    `shape`: dimensions of the flavor's config to set (field -> value, builder/models/shape.py)."""
    family = model_spec(model)
    flavor = flavor or family.default_flavor
    if flavor not in family.flavors:
        raise ValueError(f"unknown flavor {flavor!r} for {model}; available: {', '.join(family.flavors)}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; available: {', '.join(PARTITIONERS)}")
    layout = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, tp=tp)
    shaped = apply_shape(family, family.flavors[flavor], shape or {})
    check_layout(family, shaped, layout)
    default_b, default_s = DEFAULT_SHAPE.get(flavor, (1, 8192))
    batch_size = default_b if batch_size is None else batch_size
    seq_len = default_s if seq_len is None else seq_len
    if batch_size < 1 or seq_len < 2:
        raise ValueError("--batch-size must be >= 1 and --seq-len >= 2")
    if batch_size * seq_len > MAX_TOKENS_PER_RANK:
        raise ValueError(f"--batch-size {batch_size} x --seq-len {seq_len} is {batch_size * seq_len:,} tokens per rank, "
                         f"more than {MAX_TOKENS_PER_RANK:,}; use a smaller batch or more data-parallel ranks")
    if seq_len % tp:
        raise ValueError(f"--seq-len {seq_len} must be divisible by --tp {tp} (sequence parallel shards it)")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}; use bf16 or fp32")
    dtype = DTYPES[dtype] if dtype else _default_dtype(flavor)
    if ac not in AC_POLICIES:
        raise ValueError(f"unknown --ac {ac!r}; use one of {', '.join(AC_POLICIES)}")
    sizes = dict(layout.mesh_shape())
    passes = default_passes(sizes, exact_fusion=family.exact_fusion) if passes is None else tuple(passes)
    if fuse is not None:
        if fuse not in ("regions", "blocks"):
            raise ValueError(f"--fuse {fuse!r}: use regions or blocks")
        # --fuse's regions take in the exact ones.
        passes = tuple(p for p in passes if p != "fuse_exact") + (f"fuse_{fuse}",)
    check_passes(passes, sizes)
    return BuildSpec(model=model, flavor=flavor, layout=layout, batch_size=batch_size, seq_len=seq_len,
                     partitioner=partitioner, dtype=dtype, graph_passes=passes, ac=ac,
                     shape=tuple((name, getattr(shaped, name)) for name in sorted(shape or {})))


@dataclass(kw_only=True)
class BuildOutcome:
    manifest: Manifest
    """The exported artifact's manifest."""
    key: str
    """Cache key of the build."""
    hit: bool
    """True when the cache already held the build (nothing was traced)."""
    reason: str
    """Why it missed ('' on a hit)."""
    traced: list[int]
    """Ranks traced by this call."""
    traces: int = 0
    """Traces made by this call (a rank may be traced at several depths: builder/stamp.py)."""
    note: str = ""
    """How the build deviated from one program fitted from shallow traces (empty when it did
    not, or on a hit)."""


def trace_context():
    """Trace processes are forked from one server that has imported torch and the tracer once
    (builder/trace_preload.py): a fresh process for every task (trace.py says why) that does
    not import torch again. The server lives as long as this process, so later builds in it
    start their traces at once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["titan.builder.trace_preload"])
    return ctx


def _trace(spec: BuildSpec, tasks: list[tuple[int, tuple[int | None, ...]]], jobs: int,
           on_stage: Callable[[int, str], None]):
    """Yield RankResults as tasks finish; a task (rank, depths) traces one rank at those depths
    in a fresh process (see trace.py). Tasks start in the order given, each on the first free
    worker. The processes report their stages (rank_progress.py), passed on to `on_stage`
    meanwhile."""
    from titan.builder.rank_job import RankJob, start_trace_process, trace_job

    if not tasks:
        return
    ctx = trace_context()
    # After a Ctrl-C ends this process (os._exit skips the finalizers of the pool's semaphores),
    # multiprocessing's resource tracker unlinks them, as it should, and warns about each: its
    # interpreter takes this process's -W options, so that expected cleanup stays silent.
    if QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_TRACKER)
    # A Ctrl-C stops the workers from here (runtime/interrupt.py): they start with SIGINT blocked.
    forget = interrupt.on_interrupt(_stop_workers)
    # The queue starts multiprocessing's resource tracker, whose start unblocks SIGINT in the
    # calling thread when it is done: so it comes before the block below, not inside it.
    stages = ctx.Queue()
    with interrupt.children_ignore_ctrl_c():  # the pool's threads, the fork server and every worker inherit it
        pool = cf.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(tasks))), mp_context=ctx,
                                      max_tasks_per_child=1, initializer=start_trace_process,
                                      initargs=(stages, os.getpid()))
        pending = {pool.submit(trace_job, RankJob(build=spec, rank=r, depths=d)) for r, d in tasks}
    with pool:
        while pending:
            finished, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            while True:
                try:
                    on_stage(*stages.get_nowait())
                except queue.Empty:
                    break
            for fut in finished:
                yield from fut.result()
    _stop_fork_server()
    forget()


def _stop_fork_server() -> None:
    """End the fork server with the tracing: left to notice this process's exit, it would shut
    its interpreter down (torch loaded) for about a second after titan-build returned. A later
    build in this process starts a new one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)  # nothing in it to flush: its children have all exited
    server._stop()


def trace_tasks(todo: dict[int, tuple[int | None, ...]], jobs: int) -> list[tuple[int, tuple[int | None, ...]]]:
    """The (rank, depths) tasks for the ranks and depths to trace, longest first. With fewer
    workers than ranks, each depth is its own task, so that the workers finish together (a task
    costs about its depth in layers); otherwise a rank's depths share one process, which traces
    the later ones faster."""
    if len(todo) <= jobs:
        tasks = [(r, depths) for r, depths in todo.items()]
        return sorted(tasks, key=lambda t: -sum(d or 0 for d in t[1]))
    tasks = [(r, (d,)) for r, depths in todo.items() for d in depths]
    return sorted(tasks, key=lambda t: -(t[1][0] or 0))


def _stop_workers() -> None:
    """Stop every descendant but multiprocessing's resource tracker (it outlives this process to
    unlink the pool's semaphores): the fork server and the trace processes it forked, until two
    looks find none (the pool's thread may be starting one right now, and a worker is a child
    before multiprocessing lists it: it would then find its start data missing and print a
    traceback)."""
    quiet = 0
    for _ in range(40):
        workers = [pid for pid in interrupt.descendant_pids()
                   if b"resource_tracker" not in interrupt.command_line(pid)]
        if workers:
            interrupt.stop_processes(workers)
            quiet = 0
        else:
            quiet += 1
            if quiet == 2:
                return
            time.sleep(0.05)


def _store_rank(cache: Cache, rank_key: str, factors: dict, res) -> None:
    """Keep a traced rank in the cache, so that a killed build resumes without tracing it again."""
    fw, bw = cache.put_blob(res.forward), cache.put_blob(res.backward)
    meta_sha = cache.put_blob(json.dumps(replace(res.meta, forward_graph=fw, backward_graph=bw).to_json(),
                                         indent=1).encode())
    cache.put_rank(rank_key, {"factors": factors, "rank": res.rank, "forward": fw, "backward": bw,
                              "meta": meta_sha, "timings": res.timings})


def _hf_record(spec: BuildSpec) -> dict | None:
    family = spec.model_spec
    if family.hf_checkpoint is None:
        return None
    return family.hf_checkpoint(spec.cfg, list(family.init_specs(spec.cfg))).to_json()


def _cached_trace(cache: Cache, record: dict):
    from titan.builder.program import Trace

    meta = RankRecord.from_json(json.loads(cache.read_blob(record["meta"])), f"cached rank {record['rank']}")
    return Trace(rank=record["rank"], forward=cache.read_blob(record["forward"]),
                 backward=cache.read_blob(record["backward"]),
                 meta=replace(meta, forward_graph=None, backward_graph=None))


def _store_program(cache: Cache, program) -> dict:
    """A program's blobs; its metadata names its graphs, so a manifest that pairs them
    otherwise is refused at load."""
    fw, bw = cache.put_blob(program.forward), cache.put_blob(program.backward)
    meta = replace(program.meta, forward_graph=fw, backward_graph=bw).to_json()
    return {"forward": fw, "backward": bw, "meta": cache.put_blob(json.dumps(meta, indent=1).encode()),
            "bindings": program.bindings}


class _Tracer:
    """Traces ranks for one build, reusing ranks a killed build of the same key finished.
    `traces` and `keys` are by (rank, depth); depth None is the flavor's own."""

    def __init__(self, spec: BuildSpec, cache: Cache, factors: dict, jobs: int, stage, progress):
        self.spec, self.cache, self.factors, self.jobs = spec, cache, factors, jobs
        self.stage, self.progress = stage, progress
        self.traces: dict = {}
        self.keys: dict[tuple[int, int | None], str] = {}
        self.traced: list[tuple[int, int | None]] = []

    def _factors(self, rank: int, depth: int | None) -> dict:
        return rank_factors(self.factors, self.spec.layout.coordinates(rank), depth=depth)

    def trace(self, ranks: list[int], depths: Callable[[int], tuple[int | None, ...]] = lambda rank: (None,)) -> None:
        from titan.builder.program import Trace

        todo: dict[int, tuple] = {}
        for r in ranks:
            for d in depths(r):
                self.keys[r, d] = digest(self._factors(r, d))
                record = self.cache.get_rank(self.keys[r, d])
                if record is None:
                    todo[r] = todo.get(r, ()) + (d,)
                else:
                    self.traces[r, d] = _cached_trace(self.cache, record)
            self.stage(r, "queued" if r in todo else "cache hit")
        left = {r: len(depths) for r, depths in todo.items()}
        for res in _trace(self.spec, trace_tasks(todo, self.jobs), self.jobs, self.stage):
            self.stage(res.rank, "writing")
            with interrupt.deferred():  # a rank's record goes in whole or not at all
                _store_rank(self.cache, self.keys[res.rank, res.depth], self._factors(res.rank, res.depth), res)
            self.traces[res.rank, res.depth] = Trace(rank=res.rank, forward=res.forward, backward=res.backward,
                                                     meta=res.meta)
            self.traced.append((res.rank, res.depth))
            left[res.rank] -= 1
            if not left[res.rank]:
                self.stage(res.rank, "done")
            self.progress(res)


def _programs(tracer: _Tracer, spec: BuildSpec) -> tuple[list, list[int], str]:
    """(programs, program index per rank, a note on how the build deviated from one program
    fitted from shallow traces, or '')."""
    from titan.builder.deep_program import deep_program, stampable
    from titan.builder.program import NotOneProgram, one_program, probe_ranks, program_classes
    from titan.builder.stamp import NotStampable

    layout = spec.layout
    probes = probe_ranks(layout)
    note = ""
    if stampable(spec):
        try:
            return [deep_program(tracer, spec, probes)], [0] * layout.world_size, ""
        except (NotStampable, NotOneProgram) as e:
            note = f"the shallow traces do not extrapolate ({e}): traced at full depth; "
    tracer.trace(probes)
    try:
        program = one_program(layout, [tracer.traces[r, None] for r in probes])
        return [program], [0] * layout.world_size, note.removesuffix("; ")
    except NotOneProgram as e:
        tracer.trace([r for r in range(layout.world_size) if (r, None) not in tracer.traces])
        programs, assignment = program_classes(layout, [t for (r, d), t in tracer.traces.items() if d is None])
        return programs, assignment, f"{note}the ranks are not one program ({e}): traced every rank"


def _manifest_fields(spec: BuildSpec, factors: dict) -> dict:
    return {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_VERSION,
        "model": spec.model,
        "flavor": spec.flavor,
        "model_config": spec.cfg.as_dict(),
        "layout": spec.layout.as_dict(),
        "mesh": [list(d) for d in spec.layout.mesh_shape()],
        "world_size": spec.layout.world_size,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "dtype": factors["dtype"],
        "ac": factors["activation checkpointing"],
        "param_dtype": "float32",
        "torch_version": installed_torch_version(),
        "builder_version": factors["builder version"],
        "passes": list(spec.passes),
        # What the runtime needs of the model to read and write its Hugging Face checkpoints.
        RECORD: _hf_record(spec),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def nearest_entry(cache: Cache, factors: dict) -> tuple[str, list[str]] | None:
    """The cached build of the same model whose factors differ least, and how they differ."""
    best = None
    for info in cache.entries():
        other = info.entry.get("factors", {})
        if other.get("model") != factors["model"]:
            continue
        diff = describe_differences(other, factors)
        if best is None or len(diff) < len(best[1]):
            best = (info.key, diff)
    return best


def build(spec: BuildSpec, out: Path, *, cache: Cache, jobs: int, progress=lambda res: None,
          on_wait=None, on_miss=lambda reason: None,
          on_stage: Callable[[int, str], None] = lambda rank, stage: None) -> BuildOutcome:
    """Build through the cache: a hit traces nothing; a miss traces the probe ranks the cache
    lacks (a killed build's finished ranks are reused) and makes one program of them (or, when
    ranks truly differ, traces every rank: one program per class). One build per key at a
    time. `on_stage(rank, stage)` follows each traced rank through rank_progress.STAGES."""
    reached: dict[int, int] = {}

    def stage(rank: int, name: str) -> None:
        # Reports from the trace processes can arrive after their result: never step back.
        index = rank_progress.STAGES.index(name)
        if index > reached.get(rank, -1):
            reached[rank] = index
            on_stage(rank, name)

    factors = build_factors(spec)
    key = digest(factors)
    lock = cache.lock(key, on_wait=on_wait)
    try:
        entry, reason = cache.get_entry(key)
        traced: list[int] = []
        traces = 0
        if entry is None:
            on_miss(reason)
            tracer = _Tracer(spec, cache, factors, jobs, stage, progress)
            programs, assignment, note = _programs(tracer, spec)
            traced_ranks = sorted({r for r, _ in tracer.traces})
            entry = {"key": key, "factors": factors,
                     # The traced ranks' records: a rebuild after a lost entry reuses them.
                     "ranks": [tracer.keys[t] for t in sorted(tracer.traces, key=_trace_order)],
                     "programs": [_store_program(cache, p) for p in programs], "rank_programs": assignment,
                     "traced_ranks": traced_ranks, "traces": len(tracer.traces), "note": note,
                     "manifest": _manifest_fields(spec, factors), "created_ts": time.time()}
            with interrupt.deferred():
                cache.put_entry(key, entry)
            traced = sorted({r for r, _ in tracer.traced})
            traces = len(tracer.traced)
        cache.touch(key)
        manifest = export_artifact(cache, entry, out)
    finally:
        lock.release()
    return BuildOutcome(manifest=manifest, key=key, hit=not reason, reason=reason, traced=traced, traces=traces,
                        note=entry.get("note", "") if reason else "")


def _trace_order(key: tuple[int, int | None]) -> tuple[int, int]:
    rank, depth = key
    return rank, -1 if depth is None else depth


def check_replaceable(spec: BuildSpec, out: Path) -> None:
    """Refuse to replace an artifact of another build (other shapes, dtype, passes, ...):
    ValueError naming each difference. A rebuild of the same choices replaces it."""
    try:
        old = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        old = {}
    old = old if isinstance(old, dict) else {}
    new = _manifest_fields(spec, build_factors(spec))
    diffs = [f"{k.replace('_', ' ')} {old.get(k)!r} there, {new[k]!r} now" for k in SHAPING_FIELDS
             if old.get(k) != new[k]]
    if diffs:
        raise ValueError(f"{out} holds another build ({'; '.join(diffs)}); pass --replace to replace it, "
                         "or --out DIR to write this one elsewhere")

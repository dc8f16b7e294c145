"""titan-build's pipeline: validate -> cache lookup -> trace the probe ranks (in parallel
processes) -> one program with rank bindings (builder/program.py) -> store in the cache ->
export the artifact.

Nothing on the cache-hit path imports torch (the tracer is imported only on a miss)."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from titan.builder import rank_progress
from titan.builder.cache import Cache
from titan.builder.cache_key import build_factors, describe_differences, digest, rank_factors
from titan.builder.checkpointing import AC_POLICIES
from titan.builder.layout import check_layout
from titan.builder.models import model_spec
from titan.builder.models.spec import ModelConfig, ModelSpec
from titan.builder.passes import check_passes, default_passes
from titan.runtime import interrupt
from titan.runtime.artifact import ArtifactError, installed_torch_version
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

    @property
    def passes(self) -> tuple[str, ...]:
        return (f"partition:{self.partitioner}", *self.graph_passes)

    @property
    def model_spec(self) -> ModelSpec:
        return model_spec(self.model)

    @property
    def cfg(self) -> ModelConfig:
        return self.model_spec.flavors[self.flavor]

    @property
    def name(self) -> str:
        """The default artifact directory's name: model, flavor and layout, then each choice that
        shapes the graphs and differs from its default (`llama3-debug-tp2-s256-bf16-ac-full`), so
        that two different builds never share a default directory."""
        flavor = "" if self.flavor == self.model_spec.default_flavor else f"-{self.flavor}"
        return "-".join([f"{self.model}{flavor}-{self.layout.tag()}",
                         *non_default_choices(flavor=self.flavor, mesh=self.layout.mesh_shape(),
                                              batch_size=self.batch_size, seq_len=self.seq_len, dtype=self.dtype,
                                              ac=self.ac, passes=self.passes)])


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16"}


def _default_dtype(flavor: str) -> str:
    # bf16 is the GPU default; the CPU-sized debug flavor defaults to fp32.
    return "float32" if flavor == "debug" else "bfloat16"


def non_default_choices(*, flavor: str, mesh: list, batch_size: int, seq_len: int, dtype: str, ac: str,
                        passes: list[str] | tuple[str, ...]) -> list[str]:
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
    defaults = default_passes({name: size for name, size in mesh})
    fuse = next((p for p in graph_passes if p in ("fuse_regions", "fuse_blocks")), None)
    if fuse is not None:
        tags.append(fuse.replace("_", "-"))
        defaults = tuple(p for p in defaults if p != "fuse_exact") + (fuse,)
    if tuple(graph_passes) != defaults:
        tags.append("passes-" + hashlib.sha256(",".join(graph_passes).encode()).hexdigest()[:8])
    return tags


def make_spec(*, model: str, flavor: str | None, tp: int, dp_shard: int, dp_replicate: int,
              batch_size: int | None, seq_len: int | None, partitioner: str = "min_cut",
              dtype: str | None = None, passes: tuple[str, ...] | None = None, ac: str = "none",
              fuse: str | None = None) -> BuildSpec:
    """Validate user input into a BuildSpec; ValueError names what is wrong and how to fix it."""
    family = model_spec(model)
    flavor = flavor or family.default_flavor
    if flavor not in family.flavors:
        raise ValueError(f"unknown flavor {flavor!r} for {model}; available: {', '.join(family.flavors)}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; available: {', '.join(PARTITIONERS)}")
    layout = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    check_layout(family, family.flavors[flavor], layout)
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
    passes = default_passes(sizes) if passes is None else tuple(passes)
    if fuse is not None:
        if fuse not in ("regions", "blocks"):
            raise ValueError(f"--fuse {fuse!r}: use regions or blocks")
        # --fuse's regions take in the exact ones.
        passes = tuple(p for p in passes if p != "fuse_exact") + (f"fuse_{fuse}",)
    check_passes(passes, sizes)
    return BuildSpec(model=model, flavor=flavor, layout=layout, batch_size=batch_size, seq_len=seq_len,
                     partitioner=partitioner, dtype=dtype, graph_passes=passes, ac=ac)


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
    note: str = ""
    """Why the ranks are not one program (empty when they are, or on a hit)."""


def _trace(spec: BuildSpec, ranks: list[int], jobs: int, on_stage: Callable[[int, str], None]):
    """Yield RankResults as ranks finish, each traced in a fresh process (see trace.py); the
    processes report their stages (rank_progress.py), passed on to `on_stage` meanwhile."""
    from titan.builder.trace import RankJob, trace_rank

    if not ranks:
        return
    ctx = mp.get_context("spawn")
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
    with interrupt.children_ignore_ctrl_c():  # the pool's threads and every worker they start inherit it
        pool = cf.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(ranks))), mp_context=ctx,
                                      max_tasks_per_child=1, initializer=rank_progress.attach, initargs=(stages,))
        pending = {pool.submit(trace_rank, RankJob(build=spec, rank=r))
                   for r in ranks}
    with pool:
        while pending:
            finished, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            while True:
                try:
                    on_stage(*stages.get_nowait())
                except queue.Empty:
                    break
            for fut in finished:
                yield fut.result()
    forget()


def _stop_workers() -> None:
    """Stop every child but multiprocessing's resource tracker (it outlives this process to
    unlink the pool's semaphores), until two looks find none: the pool's thread may be starting
    one right now, and a worker is a child before multiprocessing lists it (it would then find
    its start data missing and print a traceback)."""
    quiet = 0
    for _ in range(40):
        workers = [pid for pid in interrupt.child_pids() if b"resource_tracker" not in interrupt.command_line(pid)]
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
    """Traces ranks for one build, reusing ranks a killed build of the same key finished."""

    def __init__(self, spec: BuildSpec, cache: Cache, factors: dict, jobs: int, stage, progress):
        self.spec, self.cache, self.factors, self.jobs = spec, cache, factors, jobs
        self.stage, self.progress = stage, progress
        self.traces: dict = {}
        self.keys: dict[int, str] = {}
        self.traced: list[int] = []

    def trace(self, ranks: list[int]) -> None:
        from titan.builder.program import Trace

        todo = []
        for r in ranks:
            rank_factors_r = rank_factors(self.factors, self.spec.layout.coordinates(r))
            self.keys[r] = digest(rank_factors_r)
            record = self.cache.get_rank(self.keys[r])
            if record is None:
                todo.append(r)
                self.stage(r, "queued")
            else:
                self.traces[r] = _cached_trace(self.cache, record)
                self.stage(r, "cache hit")
        for res in _trace(self.spec, todo, self.jobs, self.stage):
            self.stage(res.rank, "writing")
            with interrupt.deferred():  # a rank's record goes in whole or not at all
                _store_rank(self.cache, self.keys[res.rank],
                            rank_factors(self.factors, self.spec.layout.coordinates(res.rank)), res)
            self.traces[res.rank] = Trace(rank=res.rank, forward=res.forward, backward=res.backward, meta=res.meta)
            self.traced.append(res.rank)
            self.stage(res.rank, "done")
            self.progress(res)


def _programs(tracer: _Tracer, layout: Layout) -> tuple[list, list[int], str]:
    """(programs, program index per rank, why the ranks are not one program or '')."""
    from titan.builder.program import NotOneProgram, one_program, probe_ranks, program_classes

    probes = probe_ranks(layout)
    tracer.trace(probes)
    try:
        program = one_program(layout, [tracer.traces[r] for r in probes])
        return [program], [0] * layout.world_size, ""
    except NotOneProgram as e:
        tracer.trace([r for r in range(layout.world_size) if r not in tracer.traces])
        programs, assignment = program_classes(layout, list(tracer.traces.values()))
        return programs, assignment, f"{e}: traced every rank"


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
        if entry is None:
            on_miss(reason)
            tracer = _Tracer(spec, cache, factors, jobs, stage, progress)
            programs, assignment, note = _programs(tracer, spec.layout)
            entry = {"key": key, "factors": factors,
                     # The traced ranks' records: a rebuild after a lost entry reuses them.
                     "ranks": [tracer.keys[r] for r in sorted(tracer.traces)],
                     "programs": [_store_program(cache, p) for p in programs], "rank_programs": assignment,
                     "traced_ranks": sorted(tracer.traces), "note": note,
                     "manifest": _manifest_fields(spec, factors), "created_ts": time.time()}
            with interrupt.deferred():
                cache.put_entry(key, entry)
            traced = tracer.traced
        cache.touch(key)
        manifest = export_artifact(cache, entry, out)
    finally:
        lock.release()
    return BuildOutcome(manifest=manifest, key=key, hit=not reason, reason=reason, traced=sorted(traced),
                        note=entry.get("note", "") if reason else "")


def export_kernels(cache: Cache, kernels: dict[str, str], out: Path, files: dict[str, str]) -> dict[str, str]:
    """Copy the compiled regions an entry records (titan-build --kernels) into the artifact:
    kernel key -> kernels/<sha256>.kernel, each listed in `files` with its digest."""
    if not kernels:
        return {}
    from titan.runtime.kernel_store import MAX_KERNEL_BYTES, KernelStore

    store = KernelStore(cache.root / "kernels").store
    out_map = {}
    for key, sha in sorted(kernels.items()):
        rel = f"kernels/{sha}.kernel"
        if rel not in files:
            try:
                data = store.read_blob(sha, max_size=MAX_KERNEL_BYTES, what="kernel")
            except ValueError:
                continue  # gone from the store (gc): titan-run compiles that region, or rerun --kernels
            (out / "kernels").mkdir(exist_ok=True)
            (out / rel).write_bytes(data)
            files[rel] = sha
        out_map[key] = rel
    return out_map


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


def export_artifact(cache: Cache, entry: dict, out: Path) -> Manifest:
    """Copy an entry's blobs into a self-contained artifact directory (written beside `out`,
    then moved into place), so that it runs on a machine without the cache."""
    out = out.resolve()
    if out.exists() and not (out / MANIFEST).is_file():
        raise ArtifactError(f"{out} exists and is not a titan artifact; choose another --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact to {out.parent}: {e.strerror or e}; choose another --out") from None
    forget = interrupt.on_interrupt(lambda: shutil.rmtree(tmp, ignore_errors=True))
    try:
        files: dict[str, str] = {}

        def put(rel: str, sha: str) -> str:
            if rel not in files:
                path = tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(cache.read_blob(sha))
                files[rel] = sha
            return rel

        programs = [{"meta": put(f"programs/{p['meta']}.json", p["meta"]),
                     "forward": put(f"graphs/{p['forward']}.tgraph", p["forward"]),
                     "backward": put(f"graphs/{p['backward']}.tgraph", p["backward"])}
                    for p in entry["programs"]]
        kernels = export_kernels(cache, entry.get("kernels", {}), tmp, files)
        # The build's fields (recorded in its cache entry) and this copy's files, checked as
        # the runtime will check them.
        manifest = Manifest.from_json(dict(entry["manifest"], name=out.name, cache_key=entry["key"], programs=programs,
                                           rank_programs=entry["rank_programs"], files=files, kernels=kernels), out)
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))
        with interrupt.deferred():  # the old artifact or the new one at `out`, never neither
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
                os.replace(out, old / "previous")
                os.replace(tmp, out)
                shutil.rmtree(old)
            else:
                os.replace(tmp, out)
        return manifest
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact to {out}: {e.strerror or e}; free space there or choose "
                            "another --out") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        forget()

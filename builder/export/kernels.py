"""titan-build --kernels: compile a build's fusion regions (and a flex build's FlexAttention
kernels: runtime/kernels/flex_kernels.py) on one GPU of the kind the job will run on, record
them (kernel key -> sha256) in the build's cache entry, and export them into the artifact, so
that no rank of any job compiles at start-up, on this host or on a fresh one of the same GPU
kind that gets a copy of the artifact.

With --gpu NAME (builder/export/gpu_target.py) a host without a GPU builds them for that GPU
model instead: inductor generates each region's code for a stand-in device of that model, Triton
compiles it for the explicit target, and the launches are derived from the generated code
(builder/export/offline_kernels.py). That needs the torch and Triton the GPU hosts run (the
versions are part of every kernel key).

A pipeline artifact's kernels are its stages': each stage's are recorded in the stage's own cache
entry (a stage is a build of its own) and the artifact carries them all (add_pipeline_kernels).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from titan.runtime.store.build_cache import Cache
from titan.runtime.contract.manifest import Manifest

if TYPE_CHECKING:
    import torch.fx as fx

    from titan.builder.export.gpu_target import GpuTarget
    from titan.builder.spec.build_spec import BuildSpec


@dataclass(frozen=True)
class GraphSource:
    """Graphs whose regions are compiled, read from the cache or the artifact and bound to a
    rank's coordinates where they are a program with bindings (a pipeline stage's): one graph, or
    a stage's forward and backward, whose regions are compiled a second time as titan-run cuts
    them by default (a stage gathers what its parameters alone determine once per step:
    runtime/stage_gather.py; the cut moves the parameters' casts out of their regions, so those
    regions have kernel keys of their own). `gather_params`: the stage's parameter count."""
    reads: tuple[Callable[[], bytes], ...]
    coords: dict[str, int] | None = None
    gather_params: int | None = None

    def graphs(self, load: Callable[[bytes, dict[str, int] | None], fx.GraphModule]) -> list[fx.GraphModule]:
        """The graphs to compile, each decoded by `load(blob, coords)`."""
        out = [load(read(), self.coords) for read in self.reads]
        if self.gather_params is not None:
            from titan.runtime.stage_gather import gather_once

            # Decoded again: compiling a graph's regions rewrites it.
            forward, backward = (load(read(), self.coords) for read in self.reads)
            cut = gather_once(forward, backward, n_params=self.gather_params)
            out += [cut.forward, cut.backward]
        return out


def entry_graphs(cache: Cache, entry: dict) -> list[GraphSource]:
    """The distinct graphs of a build's traced ranks (its cache entry's rank records)."""
    out, seen = [], set()
    for rank_key in entry["ranks"]:
        record = cache.rank_record(rank_key)
        if record is None:
            raise ValueError("a rank record of this build is missing or not authenticated; build again")
        for sha in (record["forward"], record["backward"]):
            if sha not in seen:
                seen.add(sha)
                out.append(GraphSource(reads=(lambda sha=sha: cache.read_blob(sha),)))
    return out


def stage_graphs(art, stage: int) -> list[GraphSource]:
    """The graphs pipeline stage `stage` of artifact `art` runs, bound as its probe ranks run
    them (rank 0 of the stage's block, the rank at coordinate 1 of each mesh dimension and the
    far corner: what differs between ranks is told apart by them, as a build traces them), as
    stored and as gathered once per step."""
    from dataclasses import replace

    from titan.builder.program.bind import probe_ranks

    layout = art.layout
    per_stage = layout.world_size // layout.pp
    block = art.manifest.pipeline.schedule.stage_rank[stage] * per_stage
    out, seen = [], set()
    for local in probe_ranks(replace(layout, pp=1)):
        rank = block + local
        files = art.rank_entry(rank, stage=stage)
        coords = art.rank_coordinates(rank)
        # A program and its binding.
        bound = (art.manifest.files[files.forward], art.manifest.files[files.backward], tuple(sorted(coords.items())))
        if bound not in seen:
            seen.add(bound)
            out.append(GraphSource(reads=tuple(lambda rel=rel: art.read_verified(rel)
                                               for rel in (files.forward, files.backward)), coords=coords,
                                   gather_params=len(art.rank_record(rank, stage=stage).params)))
    return out


def compile_kernels(cache: Cache, graphs: Iterable[GraphSource], manifest: Manifest) -> tuple[dict[str, str], object]:
    """Compile (or load from the kernel store) every region of `graphs` (of `manifest`'s build)
    on cuda:0; returns (kernel key -> sha256, FusionStats)."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--kernels compiles the fusion kernels on a GPU and none is visible here; name the GPU the "
                         "job will use (--gpu h100 or h200: built without one) or run titan-build --kernels on one")
    from titan.runtime.contract.graph_decode import load_graph, region_kinds
    from titan.runtime.kernels.fusion import FusionStats, KernelSources, compile_regions
    from titan.runtime.store.kernel_store import KernelStore

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    regions = region_kinds(manifest.passes)
    # Regions hold no collectives: the groups only need names to decode.
    groups = {name: f"titan-build-{name}" for name, _ in manifest.layout.mesh_shape()}
    sources = KernelSources(device=device, store=KernelStore(cache.root / "kernels"))
    stats, memo = FusionStats(), {}
    for source in graphs:
        for gm in source.graphs(lambda blob, coords: load_graph(blob, device=device, groups=groups, regions=regions,
                                                                coords=coords)):
            compile_regions(gm, device=device, sources=sources, stats=stats, memo=memo)
    return sources.recorded, stats


@dataclass
class OfflineStats:
    """What a build for a named GPU made of the distinct regions."""
    target: str
    regions: int = 0
    planned: int = 0
    flex: int = 0
    """Of the planned ones, FlexAttention's (runtime/kernels/flex_kernels.py)."""
    left: dict[str, int] = field(default_factory=dict)
    """Why regions got no plan (they compile where they run), and how many for each reason."""
    seconds: float = 0.0

    def line(self) -> str:
        import importlib.metadata
        import torch
        left = sum(self.left.values())
        why = "; ".join(f"{n}: {reason}" for reason, n in sorted(self.left.items()))
        return (f"built without a GPU for {self.target}, torch {torch.__version__}, triton "
                f"{importlib.metadata.version('triton')}: {self.planned} of {self.regions} distinct regions as kernel "
                f"plans" + (f" ({self.flex} of them FlexAttention's)" if self.flex else "")
                + f" in {self.seconds:.1f} s" + (f"; {left} left to compile where they run ({why})" if left else ""))


def compile_kernels_offline(cache: Cache, graphs: Iterable[GraphSource], manifest: Manifest,
                            target: GpuTarget) -> tuple[dict[str, str], OfflineStats]:
    """Build every distinct region of `graphs` (of `manifest`'s build) for `target` on this
    host, no GPU needed (kernel plans already in the kernel store are reused); returns (kernel
    key -> sha256, OfflineStats)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan.builder.export.offline_kernels import derive_plan
    from titan.runtime.contract.graph_decode import load_graph, region_kinds
    from titan.runtime.kernels.flex_kernels import flex_kernel_specs
    from titan.runtime.kernels.fusion import compiled_here, region_kernels
    from titan.runtime.kernels.plan_recorder import Unplannable
    from titan.runtime.store.kernel_store import KernelStore

    t0 = time.perf_counter()
    device = torch.device("cuda", 0)
    regions = region_kinds(manifest.passes)
    groups = {name: f"titan-build-{name}" for name, _ in manifest.layout.mesh_shape()}
    store = KernelStore(cache.root / "kernels")
    stats, recorded, wanted = OfflineStats(target=target.tag), {}, {}
    for source in graphs:
        # The graphs as the GPU would load them (their device arguments name cuda:0); their
        # constants become fake CUDA tensors: only the regions' code and layouts are read.
        with FakeTensorMode(allow_non_fake_inputs=True):
            decoded = source.graphs(lambda blob, coords: load_graph(blob, device=device, groups=groups,
                                                                    regions=regions, coords=coords))
        for gm in decoded:
            wanted |= region_kernels(gm, device=target.tag)
            wanted |= flex_kernel_specs(gm, device=target.tag)  # FlexAttention's fused kernels
    for key, (kind, sub, layouts) in wanted.items():
        if not compiled_here(kind, device):
            continue
        stats.regions += 1
        found = store.load(key)
        flex = kind.startswith("flex")
        if found is not None:
            recorded[key] = found[1]
            stats.planned += 1
            stats.flex += flex
            continue
        try:
            data = derive_plan(sub, layouts, kind, target)
        except Unplannable as e:
            why = str(e)
        except Exception as e:  # inductor or Triton failed on the stand-in device: the run compiles it on its own
            why = f"generation failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        else:
            recorded[key] = store.save(key, data, device=target.tag)
            stats.planned += 1
            stats.flex += flex
            continue
        stats.left[why] = stats.left.get(why, 0) + 1
    stats.seconds = time.perf_counter() - t0
    return recorded, stats


def add_kernels(cache: Cache, key: str, out: Path, *, redo: dict | None = None,
                target: GpuTarget | None = None) -> tuple[Manifest, object]:
    """Compile the entry's kernels, record them in the entry and re-export the artifact (built
    from the entry at `out`); returns (manifest, FusionStats). `redo`: the dropless redo
    programs a bounded MoE artifact carries (BuildOutcome.redo), exported again with it (their
    own regions are compiled by titan-run). `target`: a GpuTarget to build for without a GPU.
    The stats have a `line()`."""
    from titan.builder.export.artifact import export_artifact
    from titan.runtime.contract.artifact import open_artifact

    lock = cache.lock(key)
    try:
        entry, why = cache.get_entry(key)
        if entry is None:
            raise ValueError(f"the build's cache entry is gone ({why}); build again")
        manifest = open_artifact(out, check_torch=False).manifest
        kernels, stats = _compile(cache, entry_graphs(cache, entry), manifest, target)
        entry = dict(entry, kernels=dict(entry.get("kernels", {}), **kernels))
        cache.put_entry(key, entry)
        return export_artifact(cache, dict(entry, **(redo or {})), out, with_kernels=True), stats
    finally:
        lock.release()


def add_pipeline_kernels(cache: Cache, spec: BuildSpec, out: Path, *,
                         target: GpuTarget | None = None) -> tuple[Manifest, list[object]]:
    """add_kernels for a pipeline artifact (built from `spec` at `out`): each stage's regions
    compiled as its probe ranks load them, recorded in the stage's cache entry, and the artifact
    exported again with every stage's kernels; returns (manifest, each stage's stats)."""
    from titan.builder.export.artifact import export_artifact
    from titan.builder.program.stage_programs import pipeline_artifact_entry
    from titan.builder.spec.cache_key import build_factors, digest
    from titan.runtime.contract.artifact import open_artifact

    art = open_artifact(out, check_torch=False)
    keys = [digest(build_factors(stage)) for stage in spec.stage_builds()]
    all_stats = []
    for s, key in enumerate(keys):
        lock = cache.lock(key)
        try:
            entry, why = cache.get_entry(key)
            if entry is None:
                raise ValueError(f"the cache entry of pipeline stage {s} is gone ({why}); build again")
            kernels, stats = _compile(cache, stage_graphs(art, s), art.manifest, target)
            cache.put_entry(key, dict(entry, kernels=dict(entry.get("kernels", {}), **kernels)))
            all_stats.append(stats)
        finally:
            lock.release()
    return export_artifact(cache, pipeline_artifact_entry(spec, cache=cache), out,
                           with_kernels=True), all_stats


def _compile(cache: Cache, graphs: list[GraphSource], manifest: Manifest,
             target: GpuTarget | None) -> tuple[dict[str, str], object]:
    if target is None:
        return compile_kernels(cache, graphs, manifest)
    return compile_kernels_offline(cache, graphs, manifest, target)

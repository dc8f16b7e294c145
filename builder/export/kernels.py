"""titan-build --kernels: compile a build's fusion regions on one GPU of the kind the job will
run on, record them (kernel key -> sha256) in the build's cache entry, and export them into
the artifact, so that no rank of any job compiles at start-up, on this host or on a fresh one
of the same GPU kind that gets a copy of the artifact.

A CPU-only host cannot do this: inductor generates a region's code by running on the device
(example tensors, device properties, autotuning), although Triton itself could compile a
given kernel for an explicit target without a GPU.
"""

from __future__ import annotations

from pathlib import Path

from titan.runtime.store.build_cache import Cache
from titan.runtime.contract.manifest import Manifest


def compile_kernels(cache: Cache, entry: dict, manifest: Manifest) -> tuple[dict[str, str], object]:
    """Compile (or load from the kernel store) every region of the entry's distinct graphs (built
    for `manifest`, the artifact exported from it) on cuda:0; returns (kernel key -> sha256,
    FusionStats)."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--kernels compiles the fusion kernels on a GPU and none is visible here; run titan-build "
                         "--kernels on one GPU of the kind the job will use (the build itself needs none)")
    from titan.runtime.contract.graph_decode import load_graph, region_kinds
    from titan.runtime.kernels.fusion import FusionStats, KernelSources, compile_regions
    from titan.runtime.store.kernel_store import KernelStore

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    regions = region_kinds(manifest.passes)
    # Regions hold no collectives: the groups only need names to decode.
    groups = {name: f"titan-build-{name}" for name, _ in manifest.layout.mesh_shape()}
    sources = KernelSources(device=device, store=KernelStore(cache.root / "kernels"))
    stats, memo, seen = FusionStats(), {}, set()
    for rank_key in entry["ranks"]:
        record = cache.rank_record(rank_key)
        if record is None:
            raise ValueError("a rank record of this build is missing or not authenticated; build again")
        for sha in (record["forward"], record["backward"]):
            if sha in seen:
                continue
            seen.add(sha)
            gm = load_graph(cache.read_blob(sha), device=device, groups=groups, regions=regions)
            compile_regions(gm, device=device, sources=sources, stats=stats, memo=memo)
    return sources.recorded, stats


def add_kernels(cache: Cache, key: str, out: Path, *, redo: dict | None = None) -> tuple[Manifest, object]:
    """Compile the entry's kernels, record them in the entry and re-export the artifact (built
    from the entry at `out`); returns (manifest, FusionStats). `redo`: the dropless redo
    programs a bounded MoE artifact carries (BuildOutcome.redo), exported again with it (their
    own regions are compiled by titan-run)."""
    from titan.builder.export.artifact import export_artifact
    from titan.runtime.contract.artifact import open_artifact

    lock = cache.lock(key)
    try:
        entry, why = cache.get_entry(key)
        if entry is None:
            raise ValueError(f"the build's cache entry is gone ({why}); build again")
        kernels, stats = compile_kernels(cache, entry, open_artifact(out, check_torch=False).manifest)
        entry = dict(entry, kernels=dict(entry.get("kernels", {}), **kernels))
        cache.put_entry(key, entry)
        return export_artifact(cache, dict(entry, **(redo or {})), out), stats
    finally:
        lock.release()

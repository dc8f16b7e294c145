"""titan-build's pipeline: validate -> trace every rank (in parallel processes) -> write artifact."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan.builder.layout import Layout, check_layout
from titan.builder.models.llama3 import DEFAULT_FLAVOR, FLAVORS, LlamaConfig
from titan.builder.trace import PARTITIONERS, RankJob, RankResult, trace_rank
from titan.runtime.artifact import ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST, ArtifactError

MODELS = {"llama3": FLAVORS}
# Per-flavor batch shape defaults: small on CPU, Llama-3 pretraining shape otherwise.
DEFAULT_SHAPE = {"debug": (2, 128)}
PACKAGE_ROOT = Path(__file__).resolve().parent


@dataclass(kw_only=True, frozen=True)
class BuildSpec:
    model: str
    """Model family (key of MODELS)."""
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

    @property
    def cfg(self) -> LlamaConfig:
        return MODELS[self.model][self.flavor]

    @property
    def name(self) -> str:
        flavor = "" if self.flavor == DEFAULT_FLAVOR else f"-{self.flavor}"
        return f"{self.model}{flavor}-{self.layout.tag()}"


def make_spec(*, model: str, flavor: str | None, tp: int, dp_shard: int, dp_replicate: int,
              batch_size: int | None, seq_len: int | None, partitioner: str = "min_cut") -> BuildSpec:
    """Validate user input into a BuildSpec; ValueError names what is wrong and how to fix it."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; available: {', '.join(MODELS)}")
    flavor = flavor or DEFAULT_FLAVOR
    if flavor not in MODELS[model]:
        raise ValueError(f"unknown flavor {flavor!r} for {model}; available: {', '.join(MODELS[model])}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; available: {', '.join(PARTITIONERS)}")
    layout = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    cfg = MODELS[model][flavor]
    check_layout(cfg, layout)
    default_b, default_s = DEFAULT_SHAPE.get(flavor, (1, 8192))
    batch_size = batch_size or default_b
    seq_len = seq_len or default_s
    if batch_size < 1 or seq_len < 2:
        raise ValueError("--batch-size must be >= 1 and --seq-len >= 2")
    if seq_len % tp:
        raise ValueError(f"--seq-len {seq_len} must be divisible by --tp {tp} (sequence parallel shards it)")
    return BuildSpec(model=model, flavor=flavor, layout=layout, batch_size=batch_size, seq_len=seq_len,
                     partitioner=partitioner)


def builder_version() -> str:
    """Hash of the builder's and runtime's own source: any code change makes a new version."""
    h = hashlib.sha256()
    for pkg in (PACKAGE_ROOT, PACKAGE_ROOT.parent / "runtime"):
        for path in sorted(pkg.rglob("*.py")):
            h.update(str(path.relative_to(pkg.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _trace_all(spec: BuildSpec, jobs: int, progress) -> list[RankResult]:
    rank_jobs = [RankJob(cfg=spec.cfg, layout=spec.layout, rank=r, batch_size=spec.batch_size,
                         seq_len=spec.seq_len, partitioner=spec.partitioner)
                 for r in range(spec.layout.world_size)]
    # One fresh process per rank (max_tasks_per_child=1): see trace.py on why ranks never share one.
    ctx = mp.get_context("spawn")
    results: dict[int, RankResult] = {}
    with cf.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(rank_jobs))), mp_context=ctx,
                                max_tasks_per_child=1) as pool:
        futures = {pool.submit(trace_rank, job): job.rank for job in rank_jobs}
        for fut in cf.as_completed(futures):
            res = fut.result()
            results[res.rank] = res
            progress(res)
    return [results[r] for r in range(len(rank_jobs))]


def _write_file(root: Path, rel: str, data: bytes, files: dict[str, str]) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if rel not in files:
        path.write_bytes(data)
        files[rel] = hashlib.sha256(data).hexdigest()


def write_artifact(spec: BuildSpec, results: list[RankResult], out: Path) -> dict:
    """Write the artifact to a temporary sibling of `out`, then move it into place."""
    out = out.resolve()
    if out.exists() and not (out / MANIFEST).is_file():
        raise ArtifactError(f"{out} exists and is not a titan artifact; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        return _fill_and_place(spec, results, tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fill_and_place(spec: BuildSpec, results: list[RankResult], tmp: Path, out: Path) -> dict:
    files: dict[str, str] = {}
    ranks = []
    for res in results:
        fw = f"graphs/{hashlib.sha256(res.forward).hexdigest()}.tgraph"
        bw = f"graphs/{hashlib.sha256(res.backward).hexdigest()}.tgraph"
        _write_file(tmp, fw, res.forward, files)
        _write_file(tmp, bw, res.backward, files)
        meta_rel = f"ranks/rank{res.rank}.json"
        # The rank's metadata names its graphs, so a manifest pointing a rank at another rank's
        # graphs is refused at load.
        meta = dict(res.meta, forward_graph=files[fw], backward_graph=files[bw])
        _write_file(tmp, meta_rel, json.dumps(meta, indent=1).encode(), files)
        ranks.append({"rank": res.rank, "meta": meta_rel, "forward": fw, "backward": bw})
    manifest = {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_VERSION,
        "name": out.name,
        "model": spec.model,
        "flavor": spec.flavor,
        "model_config": spec.cfg.as_dict(),
        "layout": {"dp_replicate": spec.layout.dp_replicate, "dp_shard": spec.layout.dp_shard, "tp": spec.layout.tp},
        "mesh": [list(d) for d in spec.layout.mesh_shape()],
        "world_size": spec.layout.world_size,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "dtype": "float32",
        "torch_version": torch.__version__,
        "builder_version": builder_version(),
        "passes": [f"partition:{spec.partitioner}"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": ranks,
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old / "a")
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return manifest


def build(spec: BuildSpec, out: Path, *, jobs: int, progress=lambda res: None) -> dict:
    results = _trace_all(spec, jobs, progress)
    return write_artifact(spec, results, out)

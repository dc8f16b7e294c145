"""The artifact on disk (spec: artifacts/README.md) and its verified loading."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path

from titan.runtime.contract.checks import ArtifactError
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.manifest import MANIFEST, Manifest, ProgramFiles
from titan.runtime.contract.rank_record import BufferSpec, ParamSpec, RankRecord, bind_program
from titan.runtime.common.safe_files import UnsafeFile, loads_json, read_regular

MAX_FILE_BYTES = 1 << 30
"""Largest artifact file read (an 8B graph is ~2 MB; a 405B one a few times that)."""
MAX_MANIFEST_BYTES = 16 << 20
"""Largest manifest read (DeepSeek-V3 671B at 2,048 ranks: 0.1 MB): bounded on its raw bytes,
before it is parsed."""
MAX_PROGRAM_BYTES = 16 << 20
"""Largest program metadata read (DeepSeek-V3 671B: 0.66 MB)."""


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root() -> Path:
    """The shared cache of builds and compiled kernels: $TITAN_CACHE_DIR, else ~/.cache/titan."""
    return Path(os.environ.get("TITAN_CACHE_DIR") or "~/.cache/titan").expanduser()


def installed_torch_version() -> str:
    """torch's version without importing torch (3 s here): the cache-hit path needs only this."""
    return importlib.metadata.version("torch")


def torch_release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': the local build tag does not change graphs."""
    return version.split("+", 1)[0]


@dataclass(frozen=True)
class Artifact:
    root: Path
    manifest: Manifest
    manifest_bytes: bytes = field(default=b"", compare=False, repr=False)
    """The manifest as read (and parsed): what its signature signs (runtime/kernels/artifact_trust.py)."""
    _records: dict = field(default_factory=dict, compare=False, repr=False)
    """rank -> its record, read, hash-checked and bound once (a rank asks for it more than once)."""

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def layout(self) -> Layout:
        return self.manifest.layout

    def read_verified(self, rel: str, *, max_size: int = MAX_FILE_BYTES) -> bytes:
        """Read a listed file (a regular file, reached through no link inside the artifact),
        hashing it as it is read and checking the sha256 the manifest gives it."""
        expected = self.manifest.files.get(rel) if isinstance(rel, str) else None
        if expected is None:
            raise ArtifactError(f"{self.root}: {rel} is not listed in the manifest; rebuild with titan-build")
        try:
            return read_regular(self.root, rel, max_size=max_size, what=f"{self.root}: {rel}", sha256=expected)
        except UnsafeFile as e:
            raise ArtifactError(f"{e}; rebuild with titan-build") from None

    def kernel(self, key: str) -> bytes | None:
        """The compiled region the artifact carries under `key` (titan-build --kernels), verified
        against the manifest; None if it carries none."""
        from titan.runtime.contract.manifest import MAX_KERNEL_BYTES

        rel = self.manifest.kernels.get(key)
        return None if rel is None else self.read_verified(rel, max_size=MAX_KERNEL_BYTES)

    def verify_all(self) -> None:
        for rel in self.manifest.files:
            self.read_verified(rel)

    def rank_coordinates(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each mesh dimension (of size > 1), from its rank and the
        layout alone: what its program's bindings are bound from."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ArtifactError(f"rank {rank} is outside this artifact's world size {self.world_size}")
        coords = self.layout.coordinates(rank)
        return {name: coords[name] for name, _ in self.layout.mesh_shape()}

    def rank_entry(self, rank: int, *, redo: bool = False, stage: int | None = None) -> ProgramFiles:
        """The files of the program this rank runs (`redo`: of its dropless redo program, which
        a bounded MoE artifact carries: manifest.redo_programs; `stage`: of one of its pipeline
        stages, manifest.stages_of(rank))."""
        self.rank_coordinates(rank)  # in range
        if stage is not None and stage not in self.manifest.stages_of(rank):
            raise ArtifactError(f"{self.root}: rank {rank} runs no pipeline stage {stage}")
        return self.manifest.redo_program_of(rank, stage) if redo else self.manifest.program_of(rank, stage)

    def graph_hash(self, rank: int, kind: str, *, redo: bool = False, stage: int | None = None) -> str:
        """The sha256 of the `kind` ("forward" or "backward") graph this rank runs."""
        return self.manifest.files[getattr(self.rank_entry(rank, redo=redo, stage=stage), kind)]

    def program_json(self, rank: int, *, redo: bool = False, stage: int | None = None):
        """The metadata of the program this rank runs, as stored (slices named by mesh dimension)."""
        rel = self.rank_entry(rank, redo=redo, stage=stage).meta
        try:
            return loads_json(self.read_verified(rel, max_size=MAX_PROGRAM_BYTES), f"{self.root}: program metadata {rel}")
        except UnsafeFile as e:
            raise ArtifactError(f"{e}; rebuild with titan-build") from None

    def rank_record(self, rank: int, *, redo: bool = False, stage: int | None = None) -> RankRecord:
        """The program's metadata bound to this rank and checked (once per rank); a pipeline
        stage's program states the stage it runs, which must be `stage`."""
        if (rank, redo, stage) not in self._records:
            where = f"{self.root} rank {rank}{' redo program' if redo else ''}"
            where += "" if stage is None else f" stage {stage}"
            record = bind_program(self.program_json(rank, redo=redo, stage=stage), rank=rank, layout=self.layout,
                                  where=where, what=f"{self.root}: program metadata "
                                                    f"{self.rank_entry(rank, redo=redo, stage=stage).meta}")
            expected = stage if stage is not None else (self.manifest.stages_of(rank) or (None,))[0]
            if (record.stage.index if record.stage else None) != expected:
                raise ArtifactError(f"{where}: its program is not the program of "
                                    f"{'the whole model' if expected is None else f'stage {expected}'}; "
                                    "rebuild with titan-build")
            if record.stage is not None:
                pipeline = self.manifest.pipeline.schedule
                if (record.stage.stages, record.stage.layers) != (pipeline.n_stages, pipeline.stage_layers[expected]):
                    raise ArtifactError(f"{where}: its program holds layers {list(record.stage.layers)} of "
                                        f"{record.stage.stages} stages, not what the pipeline schedule gives stage "
                                        f"{expected}; rebuild with titan-build")
            self._records[rank, redo, stage] = record
        return self._records[rank, redo, stage]


    def rank_params(self, rank: int) -> tuple[ParamSpec, ...]:
        """The parameters `rank` trains: its program's, or its pipeline stages' one after another."""
        stages = self.manifest.stages_of(rank)
        if not stages:
            return self.rank_record(rank).params
        return tuple(p for s in stages for p in self.rank_record(rank, stage=s).params)

    def rank_buffers(self, rank: int) -> tuple[BufferSpec, ...]:
        """The model buffers `rank` holds: its program's, or its pipeline stages' one after another."""
        stages = self.manifest.stages_of(rank)
        if not stages:
            return self.rank_record(rank).buffers
        return tuple(b for s in stages for b in self.rank_record(rank, stage=s).buffers)

    def model_params(self, rank: int = 0) -> tuple[ParamSpec, ...]:
        """Every parameter of the model (a checkpoint's description lists them all, with their
        global shapes): `rank`'s own program holds a shard of each; with pipeline stages, each
        stage's from the first rank that runs it."""
        if self.manifest.pipeline is None:
            return self.rank_record(rank).params
        schedule, per_block = self.manifest.pipeline.schedule, self.world_size // self.layout.pp
        return tuple(p for s in range(schedule.n_stages)
                     for p in self.rank_record(schedule.stage_rank[s] * per_block, stage=s).params)

    def model_buffers(self, rank: int = 0) -> tuple[BufferSpec, ...]:
        """Every model buffer (whole on every rank that holds one): `rank`'s program's, or with
        pipeline stages each stage's."""
        if self.manifest.pipeline is None:
            return self.rank_record(rank).buffers
        schedule, per_block = self.manifest.pipeline.schedule, self.world_size // self.layout.pp
        return tuple(b for s in range(schedule.n_stages)
                     for b in self.rank_record(schedule.stage_rank[s] * per_block, stage=s).buffers)


def open_artifact(path: str | os.PathLike, *, check_torch: bool = True) -> Artifact:
    root = Path(path)
    mpath = root / MANIFEST
    try:
        if not root.is_dir() or not os.path.lexists(mpath):
            raise ArtifactError(f"{root} is not a titan artifact (no {MANIFEST}); build one with titan-build")
        raw = read_regular(root, MANIFEST, max_size=MAX_MANIFEST_BYTES, what=str(mpath))
        manifest = loads_json(raw, str(mpath))
    except UnsafeFile as e:
        raise ArtifactError(f"{e}; rebuild with titan-build") from None
    except OSError as e:  # e.g. a path component that cannot be searched
        raise ArtifactError(f"{root} cannot be read ({e.strerror or e}); give the path of an artifact directory") from None
    manifest = Manifest.from_json(manifest, root)
    if check_torch:
        built, here = torch_release(manifest.torch_version), torch_release(installed_torch_version())
        if built != here:
            raise ArtifactError(f"{root} was built with torch {built} but this is torch {here}; "
                                f"rebuild it here with titan-build (graphs are not portable across torch versions)")
    return Artifact(root=root, manifest=manifest, manifest_bytes=raw)

"""The artifact on disk (spec: artifacts/README.md) and its verified loading."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path

from titan.runtime.contract.layout import Layout
from titan.runtime.safe_files import MAX_JSON_BYTES, UnsafeFile, loads_json, read_regular

ARTIFACT_FORMAT = "titan-artifact"
ARTIFACT_VERSION = 2  # 2: programs shared by ranks, rank values bound at load
MANIFEST = "manifest.json"
MAX_FILE_BYTES = 1 << 30
"""Largest artifact file read (an 8B graph is ~2 MB; a 405B one a few times that)."""


class ArtifactError(ValueError):
    """The artifact is missing, corrupt, or does not fit this process; the message says how to fix it."""


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
    manifest: dict
    _rank_metas: dict = field(default_factory=dict, compare=False, repr=False)
    """rank -> its metadata, read and hash-checked once (a rank asks for it more than once)."""

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def layout(self) -> Layout:
        return Layout.from_dict(self.manifest["layout"])

    def read_verified(self, rel: str, *, max_size: int = MAX_FILE_BYTES) -> bytes:
        """Read a listed file (a regular file, reached through no link inside the artifact),
        hashing it as it is read and checking the sha256 the manifest gives it."""
        expected = self.manifest["files"].get(rel) if isinstance(rel, str) else None
        if expected is None:
            raise ArtifactError(f"{self.root}: {rel} is not listed in the manifest; rebuild with titan-build")
        try:
            return read_regular(self.root, rel, max_size=max_size, what=f"{self.root}: {rel}", sha256=expected)
        except UnsafeFile as e:
            raise ArtifactError(f"{e}; rebuild with titan-build") from None

    def kernel(self, key: str) -> bytes | None:
        """The compiled region the artifact carries under `key` (titan-build --kernels), verified
        against the manifest; None if it carries none."""
        rel = self.manifest.get("kernels", {}).get(key)
        return None if rel is None else self.read_verified(rel)

    def verify_all(self) -> None:
        for rel in self.manifest["files"]:
            self.read_verified(rel)

    def rank_coordinates(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each mesh dimension (of size > 1), from its rank and the
        layout alone: what its program's bindings are bound from."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ArtifactError(f"rank {rank} is outside this artifact's world size {self.world_size}")
        coords = self.layout.coordinates(rank)
        return {name: coords[name] for name, _ in self.layout.mesh_shape()}

    def rank_entry(self, rank: int) -> dict:
        """The files of the program this rank runs: {"meta", "forward", "backward"}."""
        self.rank_coordinates(rank)  # in range
        return self.manifest["programs"][self.manifest["rank_programs"][rank]]

    def program_meta(self, rank: int) -> dict:
        """The metadata of the program this rank runs, as stored (slices named by mesh dimension)."""
        rel = self.rank_entry(rank)["meta"]
        try:
            meta = loads_json(self.read_verified(rel, max_size=MAX_JSON_BYTES), f"{self.root}: program metadata {rel}")
        except UnsafeFile as e:
            raise ArtifactError(f"{e}; rebuild with titan-build") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("params"), list):
            raise ArtifactError(f"{self.root}: program metadata {rel} is malformed; rebuild with titan-build")
        return meta

    def rank_meta(self, rank: int) -> dict:
        """The program's metadata bound to this rank (read, verified and bound once per rank)."""
        if rank not in self._rank_metas:
            self._rank_metas[rank] = self._bound_meta(rank)
        return self._rank_metas[rank]

    def _bound_meta(self, rank: int) -> dict:
        """The program's metadata bound to this rank: its rank, coordinates and parameter slices."""
        from titan.runtime.contract.bindings import bound_params
        coords = self.rank_coordinates(rank)
        meta = self.program_meta(rank)
        try:
            params = bound_params(meta["params"], coords, dict(self.layout.mesh_shape()), f"{self.root} rank {rank}")
        except ValueError as e:
            raise ArtifactError(f"{e}; rebuild with titan-build") from None
        return dict(meta, rank=rank, coords=self.layout.coordinates(rank), params=params)


def open_artifact(path: str | os.PathLike, *, check_torch: bool = True) -> Artifact:
    root = Path(path)
    mpath = root / MANIFEST
    try:
        if not root.is_dir() or not os.path.lexists(mpath):
            raise ArtifactError(f"{root} is not a titan artifact (no {MANIFEST}); build one with titan-build")
        manifest = loads_json(read_regular(root, MANIFEST, max_size=MAX_JSON_BYTES, what=str(mpath)), str(mpath))
    except UnsafeFile as e:
        raise ArtifactError(f"{e}; rebuild with titan-build") from None
    except OSError as e:  # e.g. a path component that cannot be searched
        raise ArtifactError(f"{root} cannot be read ({e.strerror or e}); give the path of an artifact directory") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{mpath} is not a titan artifact manifest; rebuild with titan-build")
    if manifest.get("format_version") != ARTIFACT_VERSION:
        raise ArtifactError(f"{root} has artifact format {manifest.get('format_version')!r}; this runtime reads "
                            f"format {ARTIFACT_VERSION}: rebuild it with this version's titan-build")
    for key in ("world_size", "mesh", "programs", "rank_programs", "files", "torch_version", "batch_size", "seq_len", "model_config"):
        if key not in manifest:
            raise ArtifactError(f"{mpath} lacks '{key}'; rebuild with titan-build")
    from titan.runtime.contract.checks import check_manifest
    check_manifest(manifest)
    if check_torch:  # after check_manifest: torch_version is a version string
        built, here = torch_release(manifest["torch_version"]), torch_release(installed_torch_version())
        if built != here:
            raise ArtifactError(f"{root} was built with torch {built} but this is torch {here}; "
                                f"rebuild it here with titan-build (graphs are not portable across torch versions)")
    return Artifact(root=root, manifest=manifest)

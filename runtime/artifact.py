"""The artifact on disk (spec: artifacts/README.md) and its verified loading."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path

from titan.runtime.layout import Layout
from titan.runtime.safe_files import MAX_JSON_BYTES, UnsafeFile, loads_json, read_regular

ARTIFACT_FORMAT = "titan-artifact"
ARTIFACT_VERSION = 1
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

    def rank_entry(self, rank: int) -> dict:
        if not 0 <= rank < self.world_size:
            raise ArtifactError(f"rank {rank} is outside this artifact's world size {self.world_size}")
        entry = self.manifest["ranks"][rank]
        if entry["rank"] != rank:
            raise ArtifactError(f"{self.root}: manifest rank table is out of order; rebuild with titan-build")
        return entry

    def rank_meta(self, rank: int) -> dict:
        if rank not in self._rank_metas:
            self._rank_metas[rank] = self._read_rank_meta(rank)
        return self._rank_metas[rank]

    def _read_rank_meta(self, rank: int) -> dict:
        try:
            meta = loads_json(self.read_verified(self.rank_entry(rank)["meta"], max_size=MAX_JSON_BYTES),
                              f"{self.root}: rank {rank} metadata")
        except UnsafeFile as e:
            raise ArtifactError(f"{e}; rebuild with titan-build") from None
        if not isinstance(meta, dict) or meta.get("rank") != rank:
            # A rank's graphs bake in its coordinates: running another rank's graphs trains wrong.
            described = meta.get("rank") if isinstance(meta, dict) else None
            raise ArtifactError(f"{self.root}: rank {rank} metadata describes rank {described!r}; "
                                "rebuild with titan-build")
        return meta


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
    for key in ("world_size", "mesh", "ranks", "files", "torch_version", "batch_size", "seq_len", "model_config"):
        if key not in manifest:
            raise ArtifactError(f"{mpath} lacks '{key}'; rebuild with titan-build")
    from titan.runtime.validate import check_manifest
    check_manifest(manifest)
    if check_torch:  # after check_manifest: torch_version is a version string
        built, here = torch_release(manifest["torch_version"]), torch_release(installed_torch_version())
        if built != here:
            raise ArtifactError(f"{root} was built with torch {built} but this is torch {here}; "
                                f"rebuild it here with titan-build (graphs are not portable across torch versions)")
    return Artifact(root=root, manifest=manifest)

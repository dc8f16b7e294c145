"""Export a build-cache entry as a self-contained artifact directory (artifacts/README.md):
its programs' blobs, the compiled kernels it records, and the manifest naming them all."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from titan.runtime.store.build_cache import Cache
import titan.runtime.common.interrupt as interrupt
from titan.runtime.common.abandoned_temps import owner_tag, remove_abandoned
from titan.runtime.contract.artifact import ArtifactError
from titan.runtime.contract.manifest import MANIFEST, Manifest


def export_artifact(cache: Cache, entry: dict, out: Path, *, with_kernels: bool = False) -> Manifest:
    """Copy an entry's blobs into a self-contained artifact directory (written beside `out`,
    then moved into place), so that it runs on a machine without the cache. The compiled kernels
    the entry records go in only `with_kernels` (titan-build --kernels): a build without the flag
    gets an artifact without kernels even where an earlier --kernels build of the same key
    recorded some, as the user asked."""
    out = out.resolve()
    if out.exists() and not (out / MANIFEST).is_file():
        raise ArtifactError(f"{out} exists and is not a titan artifact; choose another --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(out.parent, f".{out.name}.")  # a killed export's (runtime/common/abandoned_temps.py)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{owner_tag()}.", dir=out.parent))
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

        def program_files(stored: list[dict]) -> list[dict]:
            return [{"meta": put(f"programs/{p['meta']}.json", p["meta"]),
                     "forward": put(f"graphs/{p['forward']}.tgraph", p["forward"]),
                     "backward": put(f"graphs/{p['backward']}.tgraph", p["backward"])} for p in stored]

        programs = program_files(entry["programs"])
        # A bounded MoE build's dropless programs, which redo an overflowing step (builder/build.py).
        redo = {} if "redo_programs" not in entry else {
            "redo_programs": program_files(entry["redo_programs"]), "redo_rank_programs": entry["redo_rank_programs"]}
        kernels = export_kernels(cache, entry.get("kernels", {}) if with_kernels else {}, tmp, files)
        # The build's fields (recorded in its cache entry) and this copy's files, checked as
        # the runtime will check them.
        manifest = Manifest.from_json(dict(entry["manifest"], name=out.name, cache_key=entry["key"], programs=programs,
                                           rank_programs=entry["rank_programs"], files=files, kernels=kernels, **redo), out)
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))
        with interrupt.deferred():  # the old artifact or the new one at `out`, never neither
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.{owner_tag()}.", dir=out.parent))
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


def export_kernels(cache: Cache, kernels: dict[str, str], out: Path, files: dict[str, str]) -> dict[str, str]:
    """Copy the compiled regions an entry records (titan-build --kernels) into the artifact:
    kernel key -> kernels/<sha256>.kernel, each listed in `files` with its digest."""
    if not kernels:
        return {}
    from titan.runtime.store.kernel_store import MAX_KERNEL_BYTES, KernelStore

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

"""Kernels built without a GPU (titan-build --kernels --gpu NAME) against kernels built on the GPU
(titan-build --kernels), for benchmarks/gpu/gpu_offline_kernels.sh; prints short tables.

    python benchmarks/gpu/offline_kernels_compare.py device
        this GPU's properties against builder/export/gpu_target.py's record of its model
    python benchmarks/gpu/offline_kernels_compare.py compare GPU_ARTIFACT OFFLINE_ARTIFACT
        per kernel key of this GPU: byte-identical plan files, or which part of the plans differs
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def device() -> int:
    import torch

    from titan.builder.export.gpu_target import TARGETS
    from titan.runtime.kernels.fusion import device_tag

    if not torch.cuda.is_available():
        print("this GPU: none visible (run this on the GPU host)")
        return 1
    props = torch.cuda.get_device_properties(0)
    tag = device_tag(torch.device("cuda", 0))
    target = next((name for name, t in TARGETS.items() if t.tag == tag), None)
    print(f"this GPU: {tag} (torch {torch.__version__}); --gpu target: {target or 'none matches'}")
    if target is None:
        return 1
    bad = 0
    for field in TARGETS[target].__slots__:
        real, ours = getattr(props, field, None), getattr(TARGETS[target], field)
        same = real == ours or field in ("total_memory", "L2_cache_size")  # not read by codegen
        bad += not same
        print(f"  {field:34s} {str(real):24s} {'' if real == ours else f'record {ours}'}")
    return 1 if bad else 0


def _kernels(artifact: Path) -> dict[str, bytes]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    return {key: (artifact / rel).read_bytes() for key, rel in manifest.get("kernels", {}).items()}


def _difference(a: bytes, b: bytes) -> str:
    from titan.runtime.kernels.kernel_plan import decode_plan

    pa, pb = decode_plan(a), decode_plan(b)
    parts = []
    if [k.name for k in pa.kernels] != [k.name for k in pb.kernels]:
        parts.append("kernel names")
    elif [k.cubin for k in pa.kernels] != [k.cubin for k in pb.kernels]:
        parts.append(f"cubins ({sum(x.cubin != y.cubin for x, y in zip(pa.kernels, pb.kernels))} of {len(pa.kernels)})")
    for field in ("launches", "buffers", "outputs", "inputs"):
        if getattr(pa, field) != getattr(pb, field):
            parts.append(field)
    if [(k.shared, k.num_warps, k.arg_types) for k in pa.kernels] != [(k.shared, k.num_warps, k.arg_types)
                                                                        for k in pb.kernels]:
        parts.append("kernel shared/warps/arg types")
    return ", ".join(parts) or "encoding only"


def compare(gpu_artifact: Path, offline_artifact: Path) -> int:
    gpu, offline = _kernels(gpu_artifact), _kernels(offline_artifact)
    same = [k for k in gpu if k in offline and gpu[k] == offline[k]]
    differ = [k for k in gpu if k in offline and gpu[k] != offline[k]]
    only_gpu = [k for k in gpu if k not in offline]
    print(f"kernels built on this GPU: {len(gpu)}; carried by the offline artifact: {len(offline)} (all targets)")
    print(f"| same key, byte-identical plan | {len(same)} |")
    print(f"| same key, plans differ        | {len(differ)} |")
    print(f"| built here, not offline       | {len(only_gpu)} |")
    for key in differ:
        print(f"  {key}: {hashlib.sha256(gpu[key]).hexdigest()[:12]} here, "
              f"{hashlib.sha256(offline[key]).hexdigest()[:12]} offline; differ in: {_difference(gpu[key], offline[key])}")
    for key in only_gpu:
        print(f"  {key}: no offline kernel (its key differs: graph, layouts, settings, device or versions)")
    return 0 if gpu and not differ and not only_gpu else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["device"]:
        sys.exit(device())
    if sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(__doc__)

"""The GPUs titan-build --kernels --gpu NAME builds kernels for without one (issue 30).

A kernel's key names the GPU it was generated for as the runtime sees it, `torch.cuda`'s device
name and compute capability (runtime/kernels/fusion.py, device_tag), and inductor reads the
device's properties while it generates code (the SM count and register file shape its
heuristics; they are written into each kernel's source). So a target is the whole record a GPU
of that model reports, not only an architecture: `sm90` alone cannot say whether the job runs on
an H100 or an H200. benchmarks/gpu/gpu_offline_kernels.sh checks a record against the real GPU.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuTarget:
    name: str
    """torch.cuda.get_device_name() on that GPU: part of every kernel key."""
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int
    regs_per_multiprocessor: int = 65536
    max_threads_per_multi_processor: int = 2048
    max_threads_per_block: int = 1024
    warp_size: int = 32
    shared_memory_per_block_optin: int = 232448
    shared_memory_per_multiprocessor: int = 233472
    L2_cache_size: int = 50 << 20

    @property
    def tag(self) -> str:
        """The device kind in kernel keys (fusion.device_tag on that GPU)."""
        return f"{self.name} sm{self.major}{self.minor}"

    @property
    def capability(self) -> int:
        return self.major * 10 + self.minor


TARGETS = {
    "h100": GpuTarget(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                      total_memory=85_520_809_984),
    "h200": GpuTarget(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                      total_memory=150_754_820_096, L2_cache_size=60 << 20),
}
"""Hopper SXM parts (the GPU hosts'). Another model is one more record, read off it with
`python -c "import torch; print(torch.cuda.get_device_properties(0))"`."""


def gpu_target(name: str) -> GpuTarget:
    """The target named on the command line; ValueError (one line, with the fix) otherwise."""
    target = TARGETS.get(name.lower())
    if target is None:
        arch = " (an architecture alone does not name the GPU a kernel key is for)" if name.lower().startswith("sm") else ""
        raise ValueError(f"--gpu {name}: unknown GPU{arch}; use one of {', '.join(TARGETS)} (builder/export/"
                         "gpu_target.py lists them; a new model is one record there)")
    return target


def toolchain_problem(target: GpuTarget) -> str | None:
    """Why this Python cannot build kernels for `target` (the fix included), or None. It needs
    the CUDA build of torch, the torch release the GPU hosts run (the versions are part of the
    kernel key), and its Triton with the NVIDIA backend (ptxas ships inside Triton)."""
    import torch

    fix = ("install the CUDA build of the torch release the GPU hosts run, with its triton, in a separate "
           "environment (e.g. pip install torch==2.11.0 triton==3.6.0: it installs without a GPU), and run "
           "titan-build there")
    if torch.version.cuda is None or torch.version.hip is not None:
        return f"kernels for the {target.name} are CUDA code, and this torch ({torch.__version__}) is not a CUDA build; {fix}"
    try:
        importlib.metadata.version("triton")
        from triton.backends import backends
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return f"kernels for the {target.name} are compiled by Triton, which is not installed here; {fix}"
    nvidia = backends.get("nvidia")
    if nvidia is None:
        return f"this Triton has no NVIDIA backend to compile for {target.name}; {fix}"
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
        get_ptxas_version(target.capability)
    except Exception as e:  # Triton reports a missing or unusable ptxas in its own words
        return f"Triton cannot find ptxas to compile for {target.name} ({str(e)[:80]}); {fix}"
    if target.capability < 70:
        return f"{target.name} (sm{target.capability}) is older than Triton supports"
    return None

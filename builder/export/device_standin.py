"""A GPU that is not there: what inductor and Triton ask the device while they generate and
compile a region's kernels, answered from a GpuTarget record (builder/export/gpu_target.py).

What they ask, found by running inductor 2.11 / Triton 3.6 on a host without a GPU (each
failed with "Found no NVIDIA driver" or "0 active drivers" until answered):
- inductor: whether a CUDA device is there (its device interface), the device's properties
  (SM count, compute capability, registers and threads per SM, warp size: written into each
  kernel's source as `DeviceProperties`) and bf16 support, the current device index;
- Triton: the active driver, for the current target (GPUTarget("cuda", 90, 32)); inductor's
  backend hash and kernel modules ask it, and it is otherwise built by loading libcuda.

None of these needs the device itself: each is a fact about the GPU model. Nothing here runs
code on a GPU or gives out a CUDA context; a call that would (a launch, a stream, a memory
allocation) still fails, so a generated region that needs one at build time shows.
"""

from __future__ import annotations

import contextlib
import types

import torch

from titan.builder.export.gpu_target import GpuTarget


def _properties(target: GpuTarget) -> types.SimpleNamespace:
    """The fields torch.cuda.get_device_properties gives (those inductor reads, and more)."""
    fields = {f: getattr(target, f) for f in target.__slots__}
    return types.SimpleNamespace(**fields, is_integrated=False, is_multi_gpu_board=False,
                                 gcnArchName=target.name)


@contextlib.contextmanager
def standin_gpu(target: GpuTarget):
    """While open, cuda:0 is `target` to inductor and Triton (one at a time: it patches globals)."""
    from torch._dynamo import device_interface
    from triton.backends.compiler import GPUTarget as TritonTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    props = _properties(target)
    saved: list[tuple[object, str, object]] = []

    def put(owner, name: str, value) -> None:
        saved.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    answers = {"device_count": lambda: 1, "current_device": lambda: 0, "set_device": lambda device: None,
               "get_device_properties": lambda device=None: props,
               "get_device_capability": lambda device=None: (target.major, target.minor),
               "get_device_name": lambda device=None: target.name,
               "is_bf16_supported": lambda *args, **kwargs: True}
    cuda = device_interface.CudaInterface
    for name, answer in answers.items():
        put(torch.cuda, name, answer)
        if name in cuda.__dict__:  # the interface bound torch.cuda's functions when it was defined
            put(cuda, name, staticmethod(answer))
    # torch.cuda.is_available stays False (torch's own RNG and stream code would act on it);
    # inductor asks its device interface, Triton its driver class.
    put(cuda, "is_available", staticmethod(lambda: True))
    put(CudaDriver, "is_active", staticmethod(lambda: True))
    put(torch.cuda, "_DeviceGuard", lambda index: contextlib.nullcontext())

    class TargetDriver(CudaDriver):
        """Triton's CUDA driver for an explicit target: CudaDriver builds its utilities against
        libcuda, which a host without a GPU lacks; inductor checks the class, and asks only this."""

        def __init__(self):  # no libcuda
            pass

        def get_current_target(self):
            return TritonTarget("cuda", target.capability, target.warp_size)

        def get_current_device(self):
            return 0

        def get_device_capability(self, device=0):
            return (target.major, target.minor)

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

    cached = device_interface.caching_worker_device_properties.pop("cuda", None)
    device_interface.caching_worker_device_properties["cuda"] = [props]
    driver.set_active(TargetDriver())
    try:
        yield
    finally:
        driver.reset_active() if driver._default is not None else setattr(driver, "_active", None)
        device_interface.caching_worker_device_properties.pop("cuda", None)
        if cached is not None:
            device_interface.caching_worker_device_properties["cuda"] = cached
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)

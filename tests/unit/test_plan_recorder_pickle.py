"""The plan recorder (runtime/kernels/plan_recorder.py) stands in for torch._C's static CUDA
launcher while a region compiles: inductor's own caching of the kernels it loads meanwhile must
still work (issue 30: a first run printed "fx graph cache unable to serialize compiled graph ...
Can't pickle <class 'torch._C._StaticCudaLauncher'>" for each region).

CPU builds of torch have no static launcher: a Python class takes its name here (its methods
return handles as the C++ one does), and inductor's real kernel class loads through it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from titan.runtime.kernels import plan_recorder

launcher_module = pytest.importorskip("torch._inductor.runtime.static_triton_launcher")
StaticallyLaunchedCudaKernel = launcher_module.StaticallyLaunchedCudaKernel


class _StaticCudaLauncher:
    """Named as torch._C's (pickle finds a class by its module and name)."""

    launched: list = []

    @staticmethod
    def _load_kernel(path, name, shared, device):
        return (7, 1234, 32, 0)  # torch 2.13: (module, function, registers, spills)

    @staticmethod
    def _unload_kernel(module):
        pass

    @staticmethod
    def _launch_kernel(function, gx, gy, gz, num_warps, shared, arg_types, args, stream):
        _StaticCudaLauncher.launched.append(function)


_StaticCudaLauncher.__module__ = "torch._C"


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", _StaticCudaLauncher, raising=False)
    monkeypatch.setattr(plan_recorder, "_RECORDER", None)
    return _StaticCudaLauncher


def _kernel(tmp_path) -> StaticallyLaunchedCudaKernel:
    """Inductor's kernel as its compile workers hand it over: its cubin written, not yet loaded."""
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\x7fELF cubin")
    kernel = StaticallyLaunchedCudaKernel.__new__(StaticallyLaunchedCudaKernel)
    kernel.__dict__.update(name="triton_poi_fused_0", cubin_path=str(cubin), cubin_raw=None, shared=0,
                           function=None, module=None, num_warps=4, arg_tys="O", device_agnostic=False,
                           functions={}, modules={})
    return kernel


def test_a_kernel_loaded_while_recording_deep_copies_and_pickles_as_inductors_cache_does(launcher, tmp_path):
    with plan_recorder.recording() as recorder:
        kernel = _kernel(tmp_path)
        kernel.load_kernel(0)
        # TritonBundler.put_static_autotuner deep-copies the kernel; FxGraphCache pickles the copy.
        saved = pickle.dumps(copy.deepcopy(kernel))
        assert pickle.loads(saved).C_impl is recorder  # loaded from the cache while recording: recorded
    assert pickle.loads(saved).C_impl is launcher  # in a later process: the real launcher
    assert torch._C._StaticCudaLauncher is launcher


def test_the_recorder_notes_each_kernel_by_the_function_that_launches_are_made_with(launcher, tmp_path):
    with plan_recorder.recording() as recorder:
        kernel = _kernel(tmp_path)
        kernel.load_kernel(0)
        assert recorder.loaded == {1234: ("triton_poi_fused_0", b"\x7fELF cubin", 0)}
        recorder.launches = []
        recorder._launch_kernel(kernel.function, 1, 1, 1, 4, 0, "O", (None,), 0)
        assert recorder.launches[0][0] in recorder.loaded
        assert launcher.launched[-1] == 1234
        kernel.close()  # unloads through the recorder (torch 2.13)

"""A region's kernel plan (runtime/kernels/kernel_plan.py) built for a named GPU on a host
without one (titan-build --kernels --gpu NAME, issue 30).

Three steps, each what the GPU flow (runtime/kernels/fusion.py + plan_recorder.py) does, minus
the device:
1. Generate: inductor lowers the region for cuda:0 under the same settings (compile_settings)
   with fake example tensors, the device's facts answered from the target's record
   (device_standin.py). Its Triton sources and wrapper are kept; its run of the kernels at
   compile time (standalone_compile's autotuning block, which launches them on random inputs)
   is skipped: with one config per kernel it has nothing to choose.
2. Compile: each kernel through inductor's own CachingAutotuner, `precompile(warm_cache_only=
   True)`, the path inductor's compile workers take (Triton to a cubin for the explicit target,
   ptxas from the Triton wheel; no device). A kernel with more than one config would need a
   timing on the device to choose: the region gets no plan (the run compiles it).
3. Derive the launches: the generated wrapper's `call` runs on the CPU on inputs of the
   region's layouts, with its buffers allocated in host memory and each kernel's launcher
   bound to a recorder in place of torch's static CUDA launcher. The launcher code is
   inductor's own (grid from the config's block sizes, constexprs dropped, scratch pointers
   added), so the recorded launches are the ones the GPU would get, with host pointers in place
   of device ones; plan_recorder's `_plan` turns them into a plan the same way. Any op of the
   wrapper other than allocation and views (a fallback kernel) means no plan.

What the GPU flow checks by running the plan against the compiled region bit for bit cannot be
checked without the device: the GPU host does it (benchmarks/gpu/gpu_offline_kernels.sh:
byte-identical plans, titan-verify --deterministic bitwise).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from titan.builder.export.gpu_target import GpuTarget
from titan.runtime.kernels.plan_recorder import Unplannable, plan_from_launches, random_input

_ALLOCATIONS = frozenset({"aten.empty_strided.default", "aten.empty.memory_format"})
"""What the wrapper may do besides launching kernels: allocate buffers, and take views (ops that
alias their input, `is_view`)."""


class _LaunchRecorder:
    """Stands in for torch._C._StaticCudaLauncher behind each compiled kernel (as the GPU flow's
    recorder does): `loaded` maps a kernel's handle to (name, cubin, shared memory)."""

    def __init__(self):
        self.loaded: dict[int, tuple[str, bytes, int]] = {}
        self.launches: list = []

    def add(self, kernel) -> None:
        handle = len(self.loaded) + 1
        self.loaded[handle] = (kernel.name, Path(kernel.cubin_path).read_bytes(), kernel.shared)
        kernel.function = handle  # what load_kernel would set: the launcher skips loading
        kernel.n_regs = kernel.n_spills = None  # known only once loaded; used by benchmarking alone
        kernel.__dict__["C_impl"] = self  # the cached property naming the static launcher

    def _launch_kernel(self, function, gx, gy, gz, num_warps, shared, arg_types, args, stream):
        self.launches.append((function, (gx, gy, gz), num_warps, shared, arg_types, tuple(args)))


class _HostOnly(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or str(func) in _ALLOCATIONS):
            raise Unplannable(f"the region runs {func} outside its Triton kernels")
        return func(*args, **(kwargs or {}))


class _Kernel:
    """What the generated wrapper holds for a kernel until it is compiled (bound afterwards)."""

    autotuner = None

    def run(self, *args, **kwargs):
        return self.autotuner.run(*args, **kwargs)


def _fold_on_host(fold):
    """inductor's uniform-value constant folder (fx_passes/joint_graph.py, `_deduce_value`)
    learns what a constant tensor holds by making a one-element copy of it and running its
    pointwise ops for real, on the tensor's device ("TODO - do on cpu to avoid syncs", it notes);
    without a GPU that fails ("Found no NVIDIA driver", making aten.full on cuda:0). Here those
    one-element computations run on the CPU: the same values for IEEE-exact ops (casts, add,
    mul, div, sqrt); a transcendental one could round differently from the GPU's, which the GPU
    host's byte-for-byte check of the plans would show."""
    cpu = torch.device("cpu")

    def deduce(self, node):
        device = node.kwargs.get("device")
        if not (isinstance(device, torch.device) and device.type == "cuda"):
            return fold(self, node)
        kwargs = node.kwargs
        node.kwargs = {**kwargs, "device": cpu}
        try:
            return fold(self, node)
        finally:
            node.kwargs = kwargs
    return deduce


def _generate(sub: fx.GraphModule, layouts: list[dict], settings: dict):
    """(the compiled region, kernel name -> Triton source, name -> its _Kernel, the wrapper
    module) of the region for cuda:0."""
    from torch._inductor import standalone_compile
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.fx_passes import joint_graph
    import torch._inductor.config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch._inductor.codecache import PyCodeCache

    sources: dict[str, str] = {}
    kernels: dict[str, _Kernel] = {}
    modules: list = []

    def keep_source(self, kernel_name, source_code, device_str="cuda", **kwargs):
        sources[kernel_name] = source_code
        return kernels.setdefault(kernel_name, _Kernel())

    load = PyCodeCache.load_by_key_path.__func__

    def keep_module(cls, *args, **kwargs):
        module = load(cls, *args, **kwargs)
        if hasattr(module, "call"):
            modules.append(module)
        return module

    with FakeTensorMode():
        examples = [torch.empty_strided(v["shape"], v["stride"], dtype=getattr(torch, v["dtype"]), device="cuda")
                    for v in layouts]
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(settings))
        # No FX graph cache: what it would store is inductor's pickled module, of no use here.
        stack.enter_context(inductor_config.patch({"fx_graph_cache": False, "compile_threads": 1}))
        stack.enter_context(mock.patch.object(AsyncCompile, "triton", keep_source))
        stack.enter_context(mock.patch.object(PyCodeCache, "load_by_key_path", classmethod(keep_module)))
        stack.enter_context(mock.patch.object(PythonWrapperCodegen, "generate_and_run_autotune_block",
                                              lambda self: None))
        folder = joint_graph.UniformValueConstantFolder
        stack.enter_context(mock.patch.object(folder, "_deduce_value", _fold_on_host(folder._deduce_value)))
        # It warns that it saved no cache artifacts (their kernels are the stand-ins): nothing to save.
        stack.enter_context(mock.patch.object(logging.getLogger("torch._inductor.standalone_compile"), "disabled", True))
        compiled = standalone_compile(sub, examples, dynamic_shapes="from_example_inputs")
    if len(modules) != 1:
        raise Unplannable(f"inductor loaded {len(modules)} wrappers for the region")
    return compiled, sources, kernels, modules[0]


def _compile(sources: dict[str, str], kernels: dict[str, _Kernel], recorder: _LaunchRecorder) -> None:
    """Each kernel compiled for the target (no device), its launcher bound to `recorder`."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import StaticTritonCompileResult

    for name, source in sources.items():
        autotuner = getattr(PyCodeCache.load(source), name)
        autotuner.precompile(warm_cache_only=True)
        results = autotuner.compile_results
        if len(results) != 1:
            raise Unplannable("a kernel has several configs (choosing one is a timing on the device)")
        (result,) = results
        if not isinstance(result, StaticTritonCompileResult):
            raise Unplannable("a kernel cannot be launched by torch's static launcher")
        recorder.add(result.kernel)
        autotuner.launchers = [result.make_launcher()]
        kernels[name].autotuner = autotuner


def _launches(compiled, module, layouts: list[dict]):
    """Run the compiled region (inductor's wrapper and the runtime code around it) on host
    memory: (its outputs, its inputs); the launches go to the kernels' recorder."""
    module.empty_strided_cuda = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype)
    module.get_raw_stream = lambda index: 0
    inputs = [random_input(v, torch.device("cpu")) for v in layouts]
    with _HostOnly():
        outs = compiled(*inputs)
    return outs, inputs


def derive_plan(sub: fx.GraphModule | Callable[[], fx.GraphModule], layouts: list[dict], kind: str,
                target: GpuTarget) -> bytes:
    """The region's kernel plan for `target` (encoded and decode-checked); Unplannable says why
    there is none (the region then compiles where it runs). `sub` may be a function that makes
    the graph (FlexAttention's: runtime/kernels/flex_kernels.py)."""
    from titan.builder.export.device_standin import standin_gpu
    import titan.runtime.common.compiler_caches as compiler_caches
    from titan.runtime.kernels.fusion import compile_settings
    from titan.runtime.kernels.kernel_plan import BadPlan, decode_plan, encode_plan

    recorder = _LaunchRecorder()
    compiler_caches.ensure()  # private caches, and cubins without line info (REPRODUCIBLE)
    sub = sub if isinstance(sub, fx.GraphModule) else sub()
    with standin_gpu(target):
        settings = compile_settings(kind)
        compiled, sources, kernels, module = _generate(sub, layouts, settings)
        import torch._inductor.config as inductor_config
        with inductor_config.patch(settings):
            _compile(sources, kernels, recorder)
            outs, inputs = _launches(compiled, module, layouts)
    data = encode_plan(plan_from_launches(recorder.launches, outs, inputs, recorder))
    try:
        decode_plan(data)
    except BadPlan as e:
        raise Unplannable(f"the plan would be refused where it runs ({e})") from None
    return data

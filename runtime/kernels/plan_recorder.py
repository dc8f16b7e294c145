"""Record a region's kernel plan (runtime/kernels/kernel_plan.py) where inductor compiles it.

While a region compiles and runs, torch._C's static CUDA launcher (which inductor's generated
code launches its Triton kernels through) is stood in for by a recorder: every cubin it loads
and every launch it makes is noted, then passed on unchanged. The region is run twice on random
inputs of its layouts (the first run may tune and load lazily), the second run's launches become
the plan, and the plan is run on copies of the same inputs into buffers filled with 0xff: its
outputs and inputs must equal the compiled region's bit for bit, or there is no plan (a launch
made some other way, an output no launch wrote) and the region keeps inductor's artifact.

Imported only where regions are compiled, next to inductor.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch

from titan.runtime.kernels.kernel_plan import Kernel, Launch, Output, Plan, PlannedRegion


class Unplannable(Exception):
    """The region's launches cannot be replayed from data alone."""


class _Recorder:
    """Stands in for torch._C._StaticCudaLauncher (whose methods are called on the class)."""

    def __init__(self, real):
        self.real = real
        self.loaded: dict[int, tuple[str, bytes, int]] = {}  # function -> (name, cubin, shared)
        self.launches: list | None = None

    # A kernel keeps the launcher it loaded through (torch >= 2.11: the cached property
    # `C_impl`, part of its pickled state). Inductor deep-copies each kernel into the bundle
    # its FX graph cache pickles, while the recorder stands in (issue 30). Pickling the real
    # class then fails: pickle finds classes by name, and the name is the recorder's now ("Can't
    # pickle <class 'torch._C._StaticCudaLauncher'>: it's not the same object"). So no copy of a
    # kernel ever holds the real class while the recorder stands in: a copy keeps the recorder,
    # and an unpickled kernel gets whatever stands in at that moment.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_current_launcher, ())

    def __getattr__(self, name):
        # What is not recorded passes through (torch 2.13's kernels unload through `_unload_kernel`).
        return getattr(self.real, name)

    def _load_kernel(self, path, name, shared, *device):
        loaded = self.real._load_kernel(path, name, shared, *device)
        # (function, registers, spills); torch 2.13 puts the module handle first.
        self.loaded[loaded[-3]] = (name, Path(path).read_bytes(), shared)
        return loaded

    def _launch_kernel(self, function, gx, gy, gz, num_warps, shared, arg_types, args, stream):
        if self.launches is not None:
            self.launches.append((function, (gx, gy, gz), num_warps, shared, arg_types, tuple(args)))
        return self.real._launch_kernel(function, gx, gy, gz, num_warps, shared, arg_types, args, stream)


_RECORDER: _Recorder | None = None


def _current_launcher():
    """What a kernel unpickles its launcher to: the recorder while it stands in (so a kernel
    inductor loads from its cache during a recording is recorded too), else the real class."""
    return torch._C._StaticCudaLauncher


@contextlib.contextmanager
def recording():
    """Stand the recorder in for the static launcher (one per process: kernels inductor loaded
    for an earlier region may be launched by a later one)."""
    global _RECORDER
    real = getattr(torch._C, "_StaticCudaLauncher", None)
    if real is None:
        yield None
        return
    if _RECORDER is None:
        _RECORDER = _Recorder(real)
    torch._C._StaticCudaLauncher = _RECORDER
    try:
        yield _RECORDER
    finally:
        torch._C._StaticCudaLauncher = _RECORDER.real


def random_input(layout: dict, device: torch.device) -> torch.Tensor:
    shape, stride, dtype = layout["shape"], layout["stride"], getattr(torch, layout["dtype"])
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    if dtype.is_floating_point:
        flat = torch.randn(extent, device=device).to(dtype)
    elif dtype == torch.bool:
        flat = torch.rand(extent, device=device) < 0.5
    else:
        flat = torch.randint(0, 100, (extent,), device=device, dtype=dtype)
    return torch.as_strided(flat, shape, stride)


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides over a storage of the same size."""
    storage = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=t.device)
    storage.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()))
    return torch.as_strided(storage.view(t.dtype), t.shape, t.stride(), t.storage_offset())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class _Pointers:
    """Classifies the recorded run's device pointers: into an input, or into a buffer (a storage
    the region allocated), numbered as first seen."""

    def __init__(self, inputs: list[torch.Tensor]):
        self.inputs = inputs
        self.buffers: dict[int, int] = {}  # storage start -> index
        self.sizes: list[int] = []

    def _input(self, ptr: int) -> int | None:
        for i, t in enumerate(self.inputs):
            start = t.untyped_storage().data_ptr()
            if start <= ptr < start + max(1, t.untyped_storage().nbytes()) and ptr >= t.data_ptr():
                return i
        return None

    def _buffer(self, storage) -> int:
        start = storage.data_ptr()
        if start not in self.buffers:
            self.buffers[start] = len(self.sizes)
            self.sizes.append(storage.nbytes())
        index = self.buffers[start]
        self.sizes[index] = max(self.sizes[index], storage.nbytes())
        return index

    def argument(self, arg) -> tuple:
        """(kind, index, byte offset, bytes reached): the launch may reach from its pointer to the
        end of the storage it points into, and no further (what decode_plan checks)."""
        if arg is None or (isinstance(arg, int) and arg == 0):
            return ("null",)
        if not isinstance(arg, torch.Tensor):
            raise Unplannable("a pointer argument is not a tensor")
        ptr = arg.data_ptr()
        i = self._input(ptr)
        if i is not None:
            storage = self.inputs[i].untyped_storage()
            return ("in", i, ptr - self.inputs[i].data_ptr(), storage.data_ptr() + storage.nbytes() - ptr)
        storage = arg.untyped_storage()
        return ("buf", self._buffer(storage), ptr - storage.data_ptr(), storage.data_ptr() + storage.nbytes() - ptr)

    def output(self, out) -> Output:
        if not isinstance(out, torch.Tensor):
            raise Unplannable("an output is not a tensor")
        dtype = str(out.dtype).removeprefix("torch.")
        i = self._input(out.data_ptr()) if out.numel() else None
        if i is not None:
            base = self.inputs[i]
            if base.dtype != out.dtype or out.storage_offset() < base.storage_offset():
                raise Unplannable("an output views an input differently typed")
            return Output(base=("in", i), dtype=dtype, size=tuple(out.shape), stride=tuple(out.stride()),
                          offset=out.storage_offset() - base.storage_offset())
        storage = out.untyped_storage()
        if storage.nbytes() % out.element_size():
            raise Unplannable("an output's buffer is not a whole number of its elements")
        return Output(base=("buf", self._buffer(storage)), dtype=dtype, size=tuple(out.shape),
                      stride=tuple(out.stride()), offset=out.storage_offset())


def record_plan(compiled, layouts: list[dict], device: torch.device, recorder: _Recorder, *,
                inputs: Callable[[], list[torch.Tensor]] | None = None) -> Plan | None:
    """The compiled region's plan, checked bit for bit against it; None where it has none.
    `inputs` makes the inputs to record on (random ones of `layouts` by default)."""
    inputs = inputs() if inputs is not None else [random_input(v, device) for v in layouts]
    try:
        compiled(*[_clone(t) for t in inputs])  # tunes and loads whatever loads lazily
        torch.cuda.synchronize(device)
        ran = [_clone(t) for t in inputs]
        recorder.launches = []
        try:
            outs = compiled(*ran)
            launches = recorder.launches
        finally:
            recorder.launches = None
        torch.cuda.synchronize(device)
        plan = plan_from_launches(launches, outs, ran, recorder)
        replayed = [_clone(t) for t in inputs]
        got = PlannedRegion(plan, device)(*replayed, poison=True)
        torch.cuda.synchronize(device)
    except Unplannable:
        return None
    same = len(got) == len(outs) and all(map(_same_bits, got, outs)) and all(map(_same_bits, replayed, ran))
    return plan if same else None


def plan_from_launches(launches: list, outs, inputs: list[torch.Tensor], recorder) -> Plan:
    """The plan of `launches` (static-launcher calls: function, grid, warps, shared, types,
    args) that made `outs` from `inputs`; `recorder.loaded` names each function's kernel (the
    GPU's recorder here, or builder/export/offline_kernels.py's, which derives them on the CPU)."""
    pointers = _Pointers(inputs)
    kernels: dict[int, int] = {}
    kernel_list: list[Kernel] = []
    plan_launches = []
    for function, grid, num_warps, shared, arg_types, args in launches:
        if function not in recorder.loaded:
            raise Unplannable("a launched kernel was loaded before recording")
        if function not in kernels:
            name, cubin, loaded_shared = recorder.loaded[function]
            if loaded_shared != shared:
                raise Unplannable("a kernel is launched with other shared memory than it was loaded with")
            kernels[function] = len(kernel_list)
            kernel_list.append(Kernel(name=name, cubin=cubin, shared=shared, num_warps=num_warps, arg_types=arg_types))
        elif kernel_list[kernels[function]].num_warps != num_warps:
            raise Unplannable("a kernel is launched with varying warps")
        if len(args) != len(arg_types):
            raise Unplannable("a launch's arguments do not match its types")
        converted = tuple(pointers.argument(a) if ty == "O" else a for ty, a in zip(arg_types, args))
        if not all(isinstance(a, (int, float, tuple)) for a in converted):
            raise Unplannable("a scalar argument is not a number")
        plan_launches.append(Launch(kernel=kernels[function], grid=tuple(grid), args=converted))
    if not isinstance(outs, (list, tuple)):
        raise Unplannable("the region does not return a sequence")
    outputs = tuple(pointers.output(o) for o in outs)
    return Plan(kernels=tuple(kernel_list), buffers=tuple(pointers.sizes), launches=tuple(plan_launches),
                outputs=outputs, inputs=len(inputs))

"""A compiled fusion region as data: the kernels inductor generated for it and the launches its
generated code makes, replayed through torch's static CUDA launcher (torch._C) without
importing inductor, triton or any generated Python.

Importing inductor and loading its compiled artifacts costs seconds at every start; a plan
costs a cubin load per kernel. Where the region is compiled (runtime/kernels/plan_recorder.py), its
kernel launches are recorded and the plan is checked against the compiled region, bit for bit;
a region whose launches cannot be recorded that way keeps inductor's own artifact.

A plan is untrusted bytes reached through a digest like any kernel (runtime/kernels/fusion.py); it is
msgpack (no pickle), and `decode_plan` checks every field before anything reaches the launcher:
kernels are referenced by index, every pointer argument is an offset into one of the region's
inputs or into a buffer the plan allocates, and every offset lies inside it.

Format (after MAGIC): {"kernels": [{"name", "cubin", "shared", "num_warps", "arg_types"}],
"buffers": [bytes per buffer], "launches": [{"kernel", "grid": [x, y, z], "args": [...]}],
"outputs": [{"base": ["in", i] | ["buf", k], "dtype", "size", "stride", "offset"}]}.
A launch argument is ["in", i, byte offset from input i's data pointer], ["buf", k, byte offset],
["null"], or a number for a scalar slot. An output's offset is in elements of its dtype: from
the start of buffer k, or from input i's own storage offset.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

MAGIC = b"titan-kernel-plan 1\n"
SCALAR_TYPES = frozenset("bhilBHIKfd")
"""The static launcher's scalar slots (int8 .. uint64, float, double); "O" is a pointer."""
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
MAX_GRID = 2**31 - 1
MAX_SHARED = 1 << 20
MAX_ARGS = 256


def is_plan(data: bytes) -> bool:
    return data.startswith(MAGIC)


@dataclass(frozen=True)
class Kernel:
    name: str
    cubin: bytes
    shared: int
    num_warps: int
    arg_types: str


@dataclass(frozen=True)
class Launch:
    kernel: int
    grid: tuple[int, int, int]
    args: tuple


@dataclass(frozen=True)
class Output:
    base: tuple[str, int]
    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Plan:
    kernels: tuple[Kernel, ...]
    buffers: tuple[int, ...]
    launches: tuple[Launch, ...]
    outputs: tuple[Output, ...]
    inputs: int
    """How many inputs the region takes (its recorded layouts fix their shapes)."""


def encode_plan(plan: Plan) -> bytes:
    doc = {"inputs": plan.inputs,
           "kernels": [{"name": k.name, "cubin": k.cubin, "shared": k.shared, "num_warps": k.num_warps,
                        "arg_types": k.arg_types} for k in plan.kernels],
           "buffers": list(plan.buffers),
           "launches": [{"kernel": x.kernel, "grid": list(x.grid), "args": [list(a) if isinstance(a, tuple) else a
                                                                            for a in x.args]}
                        for x in plan.launches],
           "outputs": [{"base": list(o.base), "dtype": o.dtype, "size": list(o.size), "stride": list(o.stride),
                        "offset": o.offset} for o in plan.outputs]}
    return MAGIC + msgpack.packb(doc, use_bin_type=True)


class BadPlan(ValueError):
    pass


def _int(v, lo: int, hi: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadPlan(f"{what} is not an integer in [{lo}, {hi}]")
    return v


def _ints(v, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 16:
        raise BadPlan(f"{what} is not a short list")
    return tuple(_int(x, 0, 2**62, what) for x in v)


def _fields(doc, keys: set[str], what: str) -> dict:
    if not isinstance(doc, dict) or set(doc) != keys:
        raise BadPlan(f"{what} does not have exactly the fields {sorted(keys)}")
    return doc


def _pointer(arg, n_inputs: int, buffers: tuple[int, ...]) -> tuple:
    if arg == ["null"]:
        return ("null",)
    if not (isinstance(arg, list) and len(arg) == 3 and arg[0] in ("in", "buf")):
        raise BadPlan("a pointer argument is not ['in', i, offset], ['buf', k, offset] or ['null']")
    kind = arg[0]
    index = _int(arg[1], 0, (n_inputs if kind == "in" else len(buffers)) - 1, f"a pointer's {kind} index")
    # Input offsets are bounded where the plan runs (against the input's own extent).
    limit = 2**40 if kind == "in" else max(0, buffers[index] - 1)
    return (kind, index, _int(arg[2], 0, limit, "a pointer's byte offset"))


def _launch(doc, kernels: tuple[Kernel, ...], n_inputs: int, buffers: tuple[int, ...]) -> Launch:
    doc = _fields(doc, {"kernel", "grid", "args"}, "a launch")
    kernel = kernels[_int(doc["kernel"], 0, len(kernels) - 1, "a launch's kernel")]
    grid = _ints(doc["grid"], "a launch's grid")
    if len(grid) != 3 or not all(1 <= g <= MAX_GRID for g in grid):
        raise BadPlan("a launch's grid is not three positive sizes")
    args = doc["args"]
    if not isinstance(args, list) or len(args) != len(kernel.arg_types):
        raise BadPlan("a launch's arguments do not match its kernel's argument types")
    out = []
    for ty, arg in zip(kernel.arg_types, args):
        if ty == "O":
            out.append(_pointer(arg, n_inputs, buffers))
        elif ty in "fd":
            if not isinstance(arg, (int, float)) or isinstance(arg, bool):
                raise BadPlan("a float argument is not a number")
            out.append(float(arg))
        else:
            out.append(_int(arg, -2**63, 2**64 - 1, "an integer argument"))
    return Launch(kernel=doc["kernel"], grid=grid, args=tuple(out))


def _output(doc, n_inputs: int, buffers: tuple[int, ...]) -> Output:
    doc = _fields(doc, {"base", "dtype", "size", "stride", "offset"}, "an output")
    base = doc["base"]
    if not (isinstance(base, list) and len(base) == 2 and base[0] in ("in", "buf")):
        raise BadPlan("an output's base is not ['in', i] or ['buf', k]")
    _int(base[1], 0, (n_inputs if base[0] == "in" else len(buffers)) - 1, "an output's base index")
    if doc["dtype"] not in DTYPES:
        raise BadPlan(f"an output's dtype {doc['dtype']!r} is not one of {', '.join(DTYPES)}")
    size, stride = _ints(doc["size"], "an output's size"), _ints(doc["stride"], "an output's stride")
    if len(size) != len(stride):
        raise BadPlan("an output's size and stride differ in length")
    offset = _int(doc["offset"], 0, 2**40, "an output's offset")
    out = Output(base=(base[0], base[1]), dtype=doc["dtype"], size=size, stride=stride, offset=offset)
    if base[0] == "buf":
        itemsize = torch.empty((), dtype=getattr(torch, out.dtype)).element_size()
        extent = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * itemsize if all(size) else 0
        if extent > buffers[base[1]] or buffers[base[1]] % itemsize:
            raise BadPlan("an output reaches past its buffer")
    return out


def decode_plan(data: bytes) -> Plan:
    """The plan in `data` (bytes whose digest the caller verified), every field checked; BadPlan
    (a ValueError) says what is wrong."""
    if not is_plan(data):
        raise BadPlan("not a kernel plan")
    try:
        doc = msgpack.unpackb(data[len(MAGIC):], raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise BadPlan(f"the plan does not decode ({e})") from None
    doc = _fields(doc, {"inputs", "kernels", "buffers", "launches", "outputs"}, "the plan")
    n_inputs = _int(doc["inputs"], 0, 4096, "the plan's input count")
    kernels = []
    for k in doc["kernels"] if isinstance(doc["kernels"], list) else ():
        k = _fields(k, {"name", "cubin", "shared", "num_warps", "arg_types"}, "a kernel")
        if not (isinstance(k["name"], str) and k["name"].isidentifier() and isinstance(k["cubin"], bytes)):
            raise BadPlan("a kernel's name or cubin is malformed")
        types = k["arg_types"]
        if not isinstance(types, str) or len(types) > MAX_ARGS or set(types) - SCALAR_TYPES - {"O"}:
            raise BadPlan("a kernel's argument types are not static-launcher types")
        kernels.append(Kernel(name=k["name"], cubin=k["cubin"], shared=_int(k["shared"], 0, MAX_SHARED, "shared memory"),
                              num_warps=_int(k["num_warps"], 1, 32, "num_warps"), arg_types=types))
    kernels = tuple(kernels)
    if not isinstance(doc["buffers"], list) or len(doc["buffers"]) > 4096:
        raise BadPlan("the plan's buffers are not a list")
    buffers = tuple(_int(b, 0, 2**40, "a buffer's size") for b in doc["buffers"])
    if not isinstance(doc["launches"], list) or not isinstance(doc["outputs"], list):
        raise BadPlan("the plan's launches or outputs are not lists")
    launches = tuple(_launch(x, kernels, n_inputs, buffers) for x in doc["launches"])
    outputs = tuple(_output(o, n_inputs, buffers) for o in doc["outputs"])
    return Plan(kernels=kernels, buffers=buffers, launches=launches, outputs=outputs, inputs=n_inputs)


_CUBIN_DIR: Path | None = None


def _cubin_file(kernel: Kernel) -> str:
    """The launcher loads cubins from a path: a directory only this process writes."""
    global _CUBIN_DIR
    if _CUBIN_DIR is None:
        _CUBIN_DIR = Path(tempfile.mkdtemp(prefix="titan-cubins-"))
        atexit.register(shutil.rmtree, _CUBIN_DIR, ignore_errors=True)
    path = Path(tempfile.mkstemp(dir=_CUBIN_DIR, suffix=".cubin")[1])
    path.write_bytes(kernel.cubin)
    return str(path)


def _load_function(kernel: Kernel, device: torch.device) -> int:
    launcher = torch._C._StaticCudaLauncher
    path = _cubin_file(kernel)
    try:
        try:
            loaded = launcher._load_kernel(path, kernel.name, kernel.shared, device.index or 0)
        except TypeError:  # torch before the device argument
            loaded = launcher._load_kernel(path, kernel.name, kernel.shared)
    finally:
        Path(path).unlink(missing_ok=True)
    return loaded[0]


class PlannedRegion:
    """A region run from its plan: allocate its buffers, launch its kernels on the current
    stream, return its outputs."""

    def __init__(self, plan: Plan, device: torch.device):
        self.plan, self.device = plan, device
        self._functions = [_load_function(k, device) for k in plan.kernels]
        self._dtypes = [getattr(torch, o.dtype) for o in plan.outputs]
        # The furthest byte each input is pointed into (its bound is checked at each call).
        self._reach = [0] * plan.inputs
        for launch in plan.launches:
            for a in launch.args:
                if isinstance(a, tuple) and a[0] == "in":
                    self._reach[a[1]] = max(self._reach[a[1]], a[2])

    def __call__(self, *inputs: torch.Tensor, poison: bool = False):
        plan = self.plan
        if len(inputs) != plan.inputs:
            raise ValueError(f"a planned region takes {plan.inputs} inputs, got {len(inputs)}")
        for reach, t in zip(self._reach, inputs):
            if reach and reach >= t.untyped_storage().nbytes() - t.storage_offset() * t.element_size():
                raise ValueError("a planned region points past one of its inputs")
        buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in plan.buffers]
        if poison:  # checking a plan: whatever its launches do not write shows as 0xff
            for b in buffers:
                b.fill_(0xFF)
        bases = {"in": [t.data_ptr() for t in inputs], "buf": [b.data_ptr() for b in buffers]}
        stream = torch.cuda.current_stream(self.device).cuda_stream
        launcher = torch._C._StaticCudaLauncher
        for launch in plan.launches:
            kernel = plan.kernels[launch.kernel]
            args = tuple(0 if isinstance(a, tuple) and a[0] == "null" else
                         bases[a[0]][a[1]] + a[2] if isinstance(a, tuple) else a for a in launch.args)
            launcher._launch_kernel(self._functions[launch.kernel], *launch.grid, kernel.num_warps, kernel.shared,
                                    kernel.arg_types, args, stream)
        outs = []
        for out, dtype in zip(plan.outputs, self._dtypes):
            kind, index = out.base
            if kind == "buf":
                outs.append(torch.as_strided(buffers[index].view(dtype), out.size, out.stride, out.offset))
            else:
                base = inputs[index]
                if base.dtype != dtype:
                    raise ValueError("a planned region's output aliases an input of another dtype")
                outs.append(torch.as_strided(base, out.size, out.stride, base.storage_offset() + out.offset))
        return tuple(outs)

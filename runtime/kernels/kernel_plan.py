"""A compiled fusion region as data: the kernels inductor generated for it and the launches its
generated code makes, replayed through torch's static CUDA launcher (torch._C) without
importing inductor, triton or any generated Python.

Importing inductor and loading its compiled artifacts costs seconds at every start; a plan
costs a cubin load per kernel. Where the region is compiled (runtime/kernels/plan_recorder.py), its
kernel launches are recorded and the plan is checked against the compiled region, bit for bit;
a region whose launches cannot be recorded that way keeps inductor's own artifact.

A plan is untrusted bytes reached through a digest like any kernel (runtime/kernels/fusion.py); it is
msgpack (no pickle), and `decode_plan` checks every field before anything reaches the launcher,
bounds first: the structure is a header of at most MAX_HEADER bytes (so that decoding it cannot
take more than a few MiB, whatever it holds) followed by the cubins, whose sizes it gives.
Kernels are referenced by index, and every launch's full reach is checked against the region's
buffers: each pointer argument is an offset and an extent in bytes into one of the region's
inputs or into a buffer the plan allocates, and lies inside it (inputs: where the plan runs);
each grid dimension is within CUDA's limits, and a launch starts no more blocks, and passes no
integer larger, than the bytes its pointers reach (a kernel's element counts cannot exceed its
data); every kernel is launched and the launches are bounded in number; the buffers together
fit the device; and each output view lies inside its buffer or input.

What those checks cannot see is what a cubin does with its arguments: a cubin is code, which is
why a plan is loaded only from a source the user trusts (docs/trust.md).

Format: MAGIC, the header's length (4 bytes, big-endian), the header, the cubins. Header:
{"inputs", "kernels": [{"name", "cubin_size", "shared", "num_warps", "arg_types"}],
"buffers": [bytes per buffer], "launches": [{"kernel", "grid": [x, y, z], "args": [...]}],
"outputs": [{"base": ["in", i] | ["buf", k], "dtype", "size", "stride", "offset"}]}.
A launch argument is ["in", i, byte offset from input i's data pointer, bytes reached],
["buf", k, byte offset, bytes reached], ["null"], or a number for a scalar slot. An output's
offset is in elements of its dtype: from the start of buffer k, or from input i's own storage
offset.
"""

from __future__ import annotations

import atexit
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

MAGIC = b"titan-kernel-plan 2\n"
SCALAR_TYPES = frozenset("bhilBHIKfd")
"""The static launcher's scalar slots (int8 .. uint64, float, double); "O" is a pointer."""
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
          "uint8": 1, "bool": 1}
"""Output dtypes and their sizes in bytes."""
MAX_HEADER = 256 << 10
"""Largest plan structure read (a real one is under 10 KiB): it bounds what decoding costs."""
MAX_GRID = (2**31 - 1, 65535, 65535)
"""CUDA's grid limits per dimension."""
MAX_SHARED = 1 << 20
MAX_ARGS = 256
MAX_KERNELS = 256
MAX_LAUNCHES = 1024
MAX_BUFFERS = 1024
MAX_OUTPUTS = 1024
MAX_CUBIN = 64 << 20
MAX_BYTES = 1 << 40
"""Largest buffer total, offset or extent (checked again against the device where the plan runs)."""
MAX_ELEMENTS = 1 << 34
"""Largest output view, in elements (the graphs' own bound)."""


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
    """Per argument: ("in" | "buf", index, byte offset, bytes reached), ("null",) or a number."""


@dataclass(frozen=True)
class Output:
    base: tuple[str, int]
    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def extent(self) -> int:
        """Elements from the view's base to one past its last element (0 for an empty view)."""
        return self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride)) + 1 if all(self.size) else 0


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
           "kernels": [{"name": k.name, "cubin_size": len(k.cubin), "shared": k.shared, "num_warps": k.num_warps,
                        "arg_types": k.arg_types} for k in plan.kernels],
           "buffers": list(plan.buffers),
           "launches": [{"kernel": x.kernel, "grid": list(x.grid), "args": [list(a) if isinstance(a, tuple) else a
                                                                            for a in x.args]}
                        for x in plan.launches],
           "outputs": [{"base": list(o.base), "dtype": o.dtype, "size": list(o.size), "stride": list(o.stride),
                        "offset": o.offset} for o in plan.outputs]}
    header = msgpack.packb(doc, use_bin_type=True)
    return MAGIC + len(header).to_bytes(4, "big") + header + b"".join(k.cubin for k in plan.kernels)


class BadPlan(ValueError):
    pass


def _int(v, lo: int, hi: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadPlan(f"{what} is not an integer in [{lo}, {hi}]")
    return v


def _ints(v, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 16:
        raise BadPlan(f"{what} is not a short list")
    return tuple(_int(x, 0, MAX_BYTES, what) for x in v)


def _list(v, limit: int, what: str) -> list:
    if not isinstance(v, list) or len(v) > limit:
        raise BadPlan(f"{what} are not a list of at most {limit}")
    return v


def _fields(doc, keys: set[str], what: str) -> dict:
    if not isinstance(doc, dict) or set(doc) != keys:
        raise BadPlan(f"{what} does not have exactly the fields {sorted(keys)}")
    return doc


def _pointer(arg, n_inputs: int, buffers: tuple[int, ...]) -> tuple:
    if arg == ["null"]:
        return ("null",)
    if not (isinstance(arg, list) and len(arg) == 4 and arg[0] in ("in", "buf")):
        raise BadPlan("a pointer argument is not ['in', i, offset, bytes], ['buf', k, offset, bytes] or ['null']")
    kind = arg[0]
    index = _int(arg[1], 0, (n_inputs if kind == "in" else len(buffers)) - 1, f"a pointer's {kind} index")
    offset = _int(arg[2], 0, MAX_BYTES, "a pointer's byte offset")
    reach = _int(arg[3], 0, MAX_BYTES, "a pointer's extent")
    # Inputs are bounded where the plan runs (against the input's own extent); buffers here.
    if kind == "buf" and offset + reach > buffers[index]:
        raise BadPlan("a launch reaches past a buffer")
    return (kind, index, offset, reach)


def _launch(doc, kernels: tuple[Kernel, ...], n_inputs: int, buffers: tuple[int, ...]) -> Launch:
    doc = _fields(doc, {"kernel", "grid", "args"}, "a launch")
    kernel = kernels[_int(doc["kernel"], 0, len(kernels) - 1, "a launch's kernel")]
    grid = _ints(doc["grid"], "a launch's grid")
    if len(grid) != 3 or not all(1 <= g <= limit for g, limit in zip(grid, MAX_GRID)):
        raise BadPlan(f"a launch's grid is not three positive sizes within {list(MAX_GRID)}")
    args = doc["args"]
    if not isinstance(args, list) or len(args) != len(kernel.arg_types):
        raise BadPlan("a launch's arguments do not match its kernel's argument types")
    pointers = [_pointer(arg, n_inputs, buffers) for ty, arg in zip(kernel.arg_types, args) if ty == "O"]
    # What the launch can address bounds how much work it may ask for: no more blocks than bytes,
    # no element count (any integer) beyond them.
    reach = max(1, sum(p[3] for p in pointers if p[0] != "null"))
    if math.prod(grid) > reach:
        raise BadPlan(f"a launch starts {math.prod(grid)} blocks for {reach} bytes of data")
    out, pointers = [], iter(pointers)
    for ty, arg in zip(kernel.arg_types, args):
        if ty == "O":
            out.append(next(pointers))
        elif ty in "fd":
            if not isinstance(arg, (int, float)) or isinstance(arg, bool):
                raise BadPlan("a float argument is not a number")
            out.append(float(arg))
        else:
            out.append(_int(arg, -reach, reach, "an integer argument (an element count beyond its data?)"))
    return Launch(kernel=doc["kernel"], grid=grid, args=tuple(out))


def _output(doc, n_inputs: int, buffers: tuple[int, ...]) -> Output:
    doc = _fields(doc, {"base", "dtype", "size", "stride", "offset"}, "an output")
    base = doc["base"]
    if not (isinstance(base, list) and len(base) == 2 and base[0] in ("in", "buf")):
        raise BadPlan("an output's base is not ['in', i] or ['buf', k]")
    _int(base[1], 0, (n_inputs if base[0] == "in" else len(buffers)) - 1, "an output's base index")
    if not isinstance(doc["dtype"], str) or doc["dtype"] not in DTYPES:
        raise BadPlan(f"an output's dtype {str(doc['dtype'])[:20]!r} is not one of {', '.join(DTYPES)}")
    size, stride = _ints(doc["size"], "an output's size"), _ints(doc["stride"], "an output's stride")
    if len(size) != len(stride) or len(size) > 8:
        raise BadPlan("an output's size and stride differ in length or have more than 8 dimensions")
    if math.prod(size) > MAX_ELEMENTS:
        raise BadPlan(f"an output has more than {MAX_ELEMENTS} elements")
    offset = _int(doc["offset"], 0, MAX_BYTES, "an output's offset")
    out = Output(base=(base[0], base[1]), dtype=doc["dtype"], size=size, stride=stride, offset=offset)
    itemsize = DTYPES[out.dtype]
    if out.extent * itemsize > MAX_BYTES:
        raise BadPlan("an output reaches past any buffer")
    if base[0] == "buf" and (out.extent * itemsize > buffers[base[1]] or buffers[base[1]] % itemsize):
        raise BadPlan("an output reaches past its buffer")
    return out


def decode_plan(data: bytes) -> Plan:
    """The plan in `data` (bytes whose digest the caller verified), every field checked; BadPlan
    (a ValueError) says what is wrong."""
    if not is_plan(data):
        raise BadPlan("not a kernel plan")
    start = len(MAGIC) + 4
    size = int.from_bytes(data[len(MAGIC):start], "big")
    if len(data) < start or size > MAX_HEADER or start + size > len(data):
        raise BadPlan(f"the plan's header is cut short or larger than {MAX_HEADER} bytes")
    try:
        doc = msgpack.unpackb(data[start:start + size], raw=False, strict_map_key=True, max_bin_len=0,
                              max_ext_len=0, max_str_len=4096, max_array_len=max(MAX_LAUNCHES, MAX_BUFFERS),
                              max_map_len=8)
    except (ValueError, msgpack.UnpackException, RecursionError) as e:
        raise BadPlan(f"the plan does not decode ({str(e)[:80]})") from None
    doc = _fields(doc, {"inputs", "kernels", "buffers", "launches", "outputs"}, "the plan")
    n_inputs = _int(doc["inputs"], 0, 4096, "the plan's input count")
    kernels, at = [], start + size
    for k in _list(doc["kernels"], MAX_KERNELS, "the plan's kernels"):
        k = _fields(k, {"name", "cubin_size", "shared", "num_warps", "arg_types"}, "a kernel")
        if not (isinstance(k["name"], str) and k["name"].isidentifier()):
            raise BadPlan("a kernel's name is malformed")
        types = k["arg_types"]
        if not isinstance(types, str) or len(types) > MAX_ARGS or set(types) - SCALAR_TYPES - {"O"}:
            raise BadPlan("a kernel's argument types are not static-launcher types")
        cubin_size = _int(k["cubin_size"], 1, MAX_CUBIN, "a kernel's cubin size")
        if at + cubin_size > len(data):
            raise BadPlan("a kernel's cubin is cut short")
        kernels.append(Kernel(name=k["name"], cubin=data[at:at + cubin_size],
                              shared=_int(k["shared"], 0, MAX_SHARED, "shared memory"),
                              num_warps=_int(k["num_warps"], 1, 32, "num_warps"), arg_types=types))
        at += cubin_size
    if at != len(data):
        raise BadPlan("the plan has bytes after its cubins")
    kernels = tuple(kernels)
    buffers = tuple(_int(b, 0, MAX_BYTES, "a buffer's size") for b in _list(doc["buffers"], MAX_BUFFERS,
                                                                              "the plan's buffers"))
    if sum(buffers) > MAX_BYTES:
        raise BadPlan(f"the plan's buffers add up to more than {MAX_BYTES} bytes")
    launches = tuple(_launch(x, kernels, n_inputs, buffers) for x in _list(doc["launches"], MAX_LAUNCHES,
                                                                          "the plan's launches"))
    if {x.kernel for x in launches} != set(range(len(kernels))):
        raise BadPlan("the plan carries a kernel that no launch uses")
    outputs = tuple(_output(o, n_inputs, buffers) for o in _list(doc["outputs"], MAX_OUTPUTS, "the plan's outputs"))
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
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else MAX_BYTES
        if sum(plan.buffers) > total:
            raise BadPlan(f"the plan's buffers ({sum(plan.buffers)} bytes) do not fit the device ({total} bytes)")
        self._functions = [_load_function(k, device) for k in plan.kernels]
        self._dtypes = [getattr(torch, o.dtype) for o in plan.outputs]
        # The furthest byte each input is reached to, by launches and by output views (checked
        # against the input at each call: a plan knows its inputs' layouts, not their storages).
        self._reach = [0] * plan.inputs
        for launch in plan.launches:
            for a in launch.args:
                if isinstance(a, tuple) and a[0] == "in":
                    self._reach[a[1]] = max(self._reach[a[1]], a[2] + a[3])
        for out in plan.outputs:
            if out.base[0] == "in":
                self._reach[out.base[1]] = max(self._reach[out.base[1]], out.extent * DTYPES[out.dtype])

    def __call__(self, *inputs: torch.Tensor, poison: bool = False):
        plan = self.plan
        if len(inputs) != plan.inputs:
            raise ValueError(f"a planned region takes {plan.inputs} inputs, got {len(inputs)}")
        for reach, t in zip(self._reach, inputs):
            if reach > t.untyped_storage().nbytes() - t.storage_offset() * t.element_size():
                raise ValueError("a planned region reaches past one of its inputs")
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

"""Kernel plans are untrusted data: every malformed or overreaching field is refused before
anything reaches the launcher, bounds before bytes expand (the launches themselves run on GPUs:
tests/test_gpu.py)."""

from __future__ import annotations

import msgpack
import pytest

from titan.runtime.kernels.kernel_plan import (MAGIC, MAX_HEADER, BadPlan, Kernel, Launch, Output, Plan, decode_plan,
                                       encode_plan, is_plan)

CUBIN = b"\x7fELF..."


def _plan(**changes) -> Plan:
    kernel = Kernel(name="triton_poi_fused_add_0", cubin=CUBIN, shared=0, num_warps=4, arg_types="OOOi")
    fields = dict(kernels=(kernel,), buffers=(4096,), inputs=2,
                  launches=(Launch(kernel=0, grid=(8, 1, 1), args=(("in", 0, 0, 4096), ("in", 1, 0, 4096),
                                                                   ("buf", 0, 0, 4096), 1024)),),
                  outputs=(Output(base=("buf", 0), dtype="float32", size=(32, 32), stride=(32, 1), offset=0),))
    return Plan(**(fields | changes))


def _doc(plan: Plan) -> dict:
    data = encode_plan(plan)
    size = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "big")
    return msgpack.unpackb(data[len(MAGIC) + 4:len(MAGIC) + 4 + size], raw=False)


def _bytes(doc: dict, cubins: bytes = CUBIN) -> bytes:
    header = msgpack.packb(doc, use_bin_type=True)
    return MAGIC + len(header).to_bytes(4, "big") + header + cubins


def test_a_plan_round_trips_and_is_told_from_other_kernel_bytes():
    plan = _plan()
    data = encode_plan(plan)
    assert is_plan(data) and not is_plan(b"PK\x03\x04 inductor artifact")
    assert decode_plan(data) == plan


def _args(d):
    return d["launches"][0]["args"]


@pytest.mark.parametrize("edit, message", [
    # pointers and their extents
    (lambda d: _args(d).__setitem__(2, ["buf", 0, 4096, 1]), "reaches past a buffer"),
    (lambda d: _args(d).__setitem__(2, ["buf", 0, 8, 4096]), "reaches past a buffer"),
    (lambda d: _args(d).__setitem__(2, ["buf", 0, 0]), "pointer argument"),
    (lambda d: _args(d).__setitem__(0, ["in", 2, 0, 1]), "in index"),
    (lambda d: _args(d).__setitem__(0, ["in", 0, 0, 2**41]), "extent"),
    (lambda d: _args(d).__setitem__(0, ["host", 0, 0, 1]), "pointer argument"),
    (lambda d: _args(d).pop(), "argument types"),
    (lambda d: _args(d).__setitem__(3, "1024"), "integer argument"),
    # element counts and grids against the data the launch reaches
    (lambda d: _args(d).__setitem__(3, 3 * 4096 + 1), "element count beyond its data"),
    (lambda d: d["launches"][0].__setitem__("grid", [3 * 4096 + 1, 1, 1]), "blocks for 12288 bytes"),
    (lambda d: d["launches"][0].__setitem__("grid", [1, 65536, 1]), "grid"),
    (lambda d: d["launches"][0].__setitem__("grid", [2**31, 1, 1]), "grid"),
    (lambda d: d["launches"][0].__setitem__("grid", [8, 0, 1]), "grid"),
    (lambda d: d["launches"][0].__setitem__("grid", [8, 1]), "grid"),
    (lambda d: d["launches"][0].__setitem__("kernel", 1), "kernel"),
    # the number of launches, kernels, buffers
    (lambda d: d.__setitem__("launches", d["launches"] * 1025), "at most 1024|max_array_len"),
    (lambda d: d.__setitem__("launches", []), "no launch uses"),
    (lambda d: d.__setitem__("buffers", [2**40, 2**40]), "add up to more than"),
    (lambda d: d.__setitem__("buffers", [-1]), "buffer's size"),
    # kernels
    (lambda d: d["kernels"][0].__setitem__("arg_types", "OOOx"), "static-launcher types"),
    (lambda d: d["kernels"][0].__setitem__("name", "a; b"), "name"),
    (lambda d: d["kernels"][0].__setitem__("num_warps", 64), "num_warps"),
    (lambda d: d["kernels"][0].__setitem__("cubin_size", len(CUBIN) + 1), "cut short"),
    (lambda d: d["kernels"][0].__setitem__("cubin_size", len(CUBIN) - 1), "bytes after its cubins"),
    # output views
    (lambda d: d["outputs"][0].__setitem__("size", [64, 32]), "past its buffer"),
    (lambda d: d["outputs"][0].__setitem__("stride", [32, 2**20]), "past its buffer"),
    (lambda d: d["outputs"][0].__setitem__("size", [2**20, 2**20]), "more than"),
    (lambda d: d["outputs"][0].__setitem__("size", [1] * 9) or d["outputs"][0].__setitem__("stride", [1] * 9),
     "8 dimensions"),
    (lambda d: d["outputs"][0].__setitem__("dtype", "object"), "dtype"),
    (lambda d: d["outputs"][0].__setitem__("dtype", ["float32"]), "dtype"),
    (lambda d: d["outputs"][0].__setitem__("base", ["in", 5]), "base index"),
    (lambda d: d["outputs"][0].__setitem__("extra", 1), "exactly the fields"),
    (lambda d: d.pop("buffers"), "exactly the fields"),
])
def test_a_malformed_or_overreaching_plan_is_refused_with_what_is_wrong(edit, message):
    doc = _doc(_plan())
    edit(doc)
    with pytest.raises(BadPlan, match=message):
        decode_plan(_bytes(doc))


def test_bytes_that_are_not_a_plan_are_refused():
    good = encode_plan(_plan())
    for data in (b"", MAGIC, MAGIC + b"\x00\x00\x00\x01\xc1", MAGIC + b"\x00\x00\x00\x03" + msgpack.packb([1, 2]),
                 b"pickle" + good, good[:-1], good + b"x", MAGIC + (MAX_HEADER + 1).to_bytes(4, "big") + b"\x90" * 16):
        with pytest.raises(BadPlan):
            decode_plan(data)


def test_a_header_of_empty_containers_is_refused_before_it_expands():
    # 256 KiB of empty arrays would be 256 Ki Python lists; the header bound and per-container
    # limits stop it at the first one that does not fit the schema.
    header = b"\xdd" + (MAX_HEADER - 5).to_bytes(4, "big") + b"\x90" * (MAX_HEADER - 5)
    with pytest.raises(BadPlan):
        decode_plan(MAGIC + len(header).to_bytes(4, "big") + header)

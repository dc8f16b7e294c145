"""Kernel plans are untrusted data: every malformed or overreaching field is refused before
anything reaches the launcher (the launches themselves run on GPUs: tests/test_gpu.py)."""

from __future__ import annotations

import msgpack
import pytest

from titan.runtime.kernels.kernel_plan import (MAGIC, BadPlan, Kernel, Launch, Output, Plan, decode_plan, encode_plan,
                                       is_plan)


def _plan(**changes) -> Plan:
    kernel = Kernel(name="triton_poi_fused_add_0", cubin=b"\x7fELF...", shared=0, num_warps=4, arg_types="OOOi")
    fields = dict(kernels=(kernel,), buffers=(4096,), inputs=2,
                  launches=(Launch(kernel=0, grid=(8, 1, 1), args=(("in", 0, 0), ("in", 1, 0), ("buf", 0, 0), 1024)),),
                  outputs=(Output(base=("buf", 0), dtype="float32", size=(32, 32), stride=(32, 1), offset=0),))
    return Plan(**(fields | changes))


def _doc(plan: Plan) -> dict:
    return msgpack.unpackb(encode_plan(plan)[len(MAGIC):], raw=False)


def _bytes(doc: dict) -> bytes:
    return MAGIC + msgpack.packb(doc, use_bin_type=True)


def test_a_plan_round_trips_and_is_told_from_other_kernel_bytes():
    plan = _plan()
    data = encode_plan(plan)
    assert is_plan(data) and not is_plan(b"PK\x03\x04 inductor artifact")
    assert decode_plan(data) == plan


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["launches"][0]["args"].__setitem__(2, ["buf", 0, 4096]), "byte offset"),
    (lambda d: d["launches"][0]["args"].__setitem__(0, ["in", 2, 0]), "in index"),
    (lambda d: d["launches"][0]["args"].__setitem__(0, ["host", 0, 0]), "pointer argument"),
    (lambda d: d["launches"][0]["args"].pop(), "argument types"),
    (lambda d: d["launches"][0]["args"].__setitem__(3, "1024"), "integer argument"),
    (lambda d: d["launches"][0].__setitem__("kernel", 1), "kernel"),
    (lambda d: d["launches"][0].__setitem__("grid", [8, 0, 1]), "grid"),
    (lambda d: d["kernels"][0].__setitem__("arg_types", "OOOx"), "static-launcher types"),
    (lambda d: d["kernels"][0].__setitem__("name", "a; b"), "name or cubin"),
    (lambda d: d["kernels"][0].__setitem__("num_warps", 64), "num_warps"),
    (lambda d: d["outputs"][0].__setitem__("size", [64, 32]), "past its buffer"),
    (lambda d: d["outputs"][0].__setitem__("dtype", "object"), "dtype"),
    (lambda d: d["outputs"][0].__setitem__("base", ["in", 5]), "base index"),
    (lambda d: d["outputs"][0].__setitem__("extra", 1), "exactly the fields"),
    (lambda d: d.pop("buffers"), "exactly the fields"),
    (lambda d: d.__setitem__("buffers", [-1]), "buffer's size"),
])
def test_a_malformed_plan_is_refused_with_what_is_wrong(edit, message):
    doc = _doc(_plan())
    edit(doc)
    with pytest.raises(BadPlan, match=message):
        decode_plan(_bytes(doc))


def test_bytes_that_are_not_a_plan_are_refused():
    for data in (b"", MAGIC + b"\xc1", MAGIC + msgpack.packb([1, 2]), b"pickle" + encode_plan(_plan())):
        with pytest.raises(BadPlan):
            decode_plan(data)

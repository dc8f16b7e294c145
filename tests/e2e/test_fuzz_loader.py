"""Fuzzing the artifact loader: mutated graph blobs, graph documents, manifests and rank
metadata (with hashes recomputed, as a crafted artifact would have them), and hostile kernel
plans (runtime/kernels/kernel_plan.py), and tampered, forged, moved or planted content-store records
(runtime/store/record.py). Every case must end in a clear error (a ValueError subclass) or
a well-formed load: no other exception, no hang over 5 s, no code from the artifact executed,
and (plans, records) bounded memory while decoding one. A record is served only unchanged (as this
user's key signed it at that name), else refused with a one-line reason or a one-line StoreError.

TITAN_FUZZ_EXAMPLES sets the examples per strategy (CI runs a fast slice)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import signal
import sys
import types

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.graph_decode import load_graph
from titan.runtime.train import GraphProgram

EXAMPLES = int(os.environ.get("TITAN_FUZZ_EXAMPLES", "30"))
REPORT = os.environ.get("TITAN_FUZZ_REPORT")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HOSTILE_TARGETS = ["builtins.eval", "builtins.exec", "os.system", "posix.system", "subprocess.Popen",
                   "torch.load", "pickle.loads", "titan_fuzz_canary.boom.default", "aten.from_file.default",
                   "aten.as_strided.default", "aten.set_.source_Storage", "aten..default", "", "getitem.x",
                   "aten.mm", "aten.mm.nonexistent", "__import__"]
CANARY_CALLS: list[str] = []
OUTCOMES: dict[str, dict[str, int]] = {}


@pytest.fixture(scope="module", autouse=True)
def canary():
    """Anything an artifact could name to run code records itself here instead."""
    module = types.ModuleType("titan_fuzz_canary")
    module.boom = types.SimpleNamespace(default=lambda *a, **k: CANARY_CALLS.append("boom"))
    sys.modules["titan_fuzz_canary"] = module
    real_system = os.system
    os.system = lambda *a, **k: CANARY_CALLS.append("os.system") or 0
    yield
    os.system = real_system
    del sys.modules["titan_fuzz_canary"]
    assert not CANARY_CALLS, f"artifact content executed code: {CANARY_CALLS}"


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def expect_clean(category: str, fn, *args, **kwargs):
    """Run fn under a 5 s alarm: a ValueError is a clean rejection, anything else fails."""
    counts = OUTCOMES.setdefault(category, {"accepted": 0, "rejected": 0})
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(5)
    try:
        fn(*args, **kwargs)
        counts["accepted"] += 1
    except _Hang:
        pytest.fail("loader hung for over 5 s")
    except ValueError as e:
        assert str(e), "errors must say what is wrong"
        counts["rejected"] += 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    _write_report()


def _write_report() -> None:
    if REPORT:  # long runs: the table so far, readable while the run goes on
        with open(REPORT, "w") as f:
            json.dump(OUTCOMES, f, indent=1, sort_keys=True)


@pytest.fixture(scope="module")
def single(debug_artifact):
    return debug_artifact()


@pytest.fixture(scope="module")
def blobs(single, debug_artifact):
    art = open_artifact(single)
    entry = art.rank_entry(0)
    tp = open_artifact(debug_artifact(tp=2))
    return [art.read_verified(entry.forward), art.read_verified(entry.backward),
            tp.read_verified(tp.rank_entry(1).forward)]


def _load(blob: bytes):
    load_graph(blob, device=torch.device("cpu"), groups={"tp": "fuzz"}, regions=frozenset({"exact"}))


@FUZZ
@given(data=st.data())
def test_byte_level_mutations(blobs, data):
    blob = bytearray(data.draw(st.sampled_from(blobs)))
    how = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    if how == "flip":
        for pos in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
            blob[pos] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        blob = blob[:data.draw(st.integers(0, len(blob) - 1))]
    else:
        pos = data.draw(st.integers(0, len(blob)))
        blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    expect_clean(f"graph bytes: {how}", _load, bytes(blob))


# Integers within msgpack's 64-bit range (it cannot encode wider ones).
INT64 = st.integers(-(2 ** 63), 2 ** 63 - 1)
JSON_JUNK = st.one_of(st.none(), st.booleans(), INT64, st.floats(allow_nan=True),
                      st.text(max_size=20), st.lists(st.integers(-3, 3), max_size=4),
                      st.dictionaries(st.text(max_size=4), INT64, max_size=2))
JUNK = st.one_of(st.none(), st.booleans(), INT64, st.floats(allow_nan=True),
                 st.text(max_size=20), st.binary(max_size=8), st.lists(st.integers(-3, 3), max_size=4),
                 st.dictionaries(st.text(max_size=4), INT64, max_size=2),
                 st.sampled_from([{"$n": 10 ** 9}, {"$n": -1}, {"$t": "x"}, {"$dtype": "evil"},
                                  {"$device": "cuda:7"}, {"$group": "world"}, [2 ** 40, 2 ** 40]]))


@FUZZ
@given(data=st.data())
def test_document_level_mutations(blobs, data):
    doc = msgpack.unpackb(data.draw(st.sampled_from(blobs)), raw=False)
    nodes = doc["nodes"]
    i = data.draw(st.integers(0, len(nodes) - 1))
    node = nodes[i]
    how = data.draw(st.sampled_from(["target", "ref", "junk-arg", "junk-field", "drop-field", "name",
                                     "op", "cycle", "absurd-size", "constants"]))
    if how == "target":
        node["op"], node["target"] = "call_function", data.draw(st.sampled_from(HOSTILE_TARGETS))
        node.setdefault("args", [])
    elif how == "ref":
        node["args"] = [{"$n": data.draw(st.integers(-5, len(nodes) + 5))}] + list(node.get("args", []))[1:]
    elif how == "junk-arg" and node.get("args"):
        node["args"][data.draw(st.integers(0, len(node["args"]) - 1))] = data.draw(JUNK)
    elif how == "junk-field":
        node[data.draw(st.sampled_from(["args", "kwargs", "target", "name", "op", "val"]))] = data.draw(JUNK)
    elif how == "drop-field":
        node.pop(data.draw(st.sampled_from(["args", "kwargs", "target", "name", "op"])), None)
    elif how == "name":
        node["name"] = data.draw(st.sampled_from(["x; import os", "__import__('os')", "a" * 500, "", "1abc",
                                                  nodes[0]["name"]]))
    elif how == "op":
        node["op"] = data.draw(st.sampled_from(["call_module", "call_method", "get_attr", "output", "placeholder"]))
    elif how == "cycle":
        node["args"] = [{"$n": i}, {"$n": min(i + 1, len(nodes) - 1)}]
    elif how == "absurd-size":
        node["op"], node["target"] = "call_function", "aten.empty.memory_format"
        node["args"], node["kwargs"] = [[2 ** 31, 2 ** 31, 2 ** 31]], {}
    else:
        doc["constants"] = data.draw(st.one_of(st.binary(max_size=64), JUNK))
    expect_clean(f"graph document: {how}", _load, msgpack.packb(doc, use_bin_type=True))


def _rehash(root) -> None:
    mpath = root / "manifest.json"
    try:
        m = json.loads(mpath.read_text())
    except (RecursionError, ValueError):
        return  # the mutation made the manifest itself unreadable: nothing to rehash
    if isinstance(m, dict) and isinstance(m.get("files"), dict):
        for rel in list(m["files"]):
            path = root / rel if isinstance(rel, str) and ".." not in rel else None
            if path is not None and path.is_file():
                m["files"][rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    mpath.write_text(json.dumps(m))


def _open_and_bind(root) -> None:
    art = open_artifact(root)
    art.verify_all()
    GraphProgram(art, 0, device=torch.device("cpu"), mesh=None, seed=0)


def _mutate_json(value, data, depth=0):
    if isinstance(value, dict) and value and depth < 4 and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(value, key=str)))
        action = data.draw(st.sampled_from(["recurse", "replace", "delete"]))
        if action == "recurse":
            value[key] = _mutate_json(value[key], data, depth + 1)
        elif action == "replace":
            value[key] = data.draw(JSON_JUNK)
        else:
            del value[key]
        return value
    if isinstance(value, list) and value and depth < 4 and data.draw(st.booleans()):
        j = data.draw(st.integers(0, len(value) - 1))
        value[j] = _mutate_json(value[j], data, depth + 1)
        return value
    return data.draw(st.one_of(JSON_JUNK, st.sampled_from(["../../../../etc/passwd", "/etc/passwd", 0, -1, 2 ** 62])))


@FUZZ
@given(data=st.data())
def test_manifest_and_metadata_mutations(single, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz") / "art"
    shutil.copytree(single, root)
    program_meta = json.loads((root / "manifest.json").read_text())["programs"][0]["meta"]
    target = data.draw(st.sampled_from(["manifest.json", program_meta]))
    path = root / target
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(_mutate_json(copy.deepcopy(doc), data)))
    _rehash(root)
    expect_clean(f"{target} (rehashed)", _open_and_bind, root)


_ATEN: list[str] = []


def _all_aten_ops() -> list[str]:
    """Every overload in torch.ops.aten (about 2,500 ops): what a crafted graph could name."""
    if not _ATEN:
        for op in sorted(dir(torch.ops.aten)):
            packet = getattr(torch.ops.aten, op, None)
            overloads = getattr(packet, "overloads", None)
            if callable(overloads):
                _ATEN.extend(f"aten.{op}.{ov}" for ov in overloads())
    return _ATEN


@FUZZ
@given(data=st.data())
def test_op_target_swaps_across_aten(blobs, data):
    doc = msgpack.unpackb(data.draw(st.sampled_from(blobs)), raw=False)
    calls = [n for n in doc["nodes"] if n.get("op") == "call_function"]
    for node in data.draw(st.lists(st.sampled_from(calls), min_size=1, max_size=3)):
        node["target"] = data.draw(st.sampled_from(_all_aten_ops()))
    expect_clean("graph document: op swapped across aten", _load, msgpack.packb(doc, use_bin_type=True))


@FUZZ
@given(data=st.data())
def test_deep_nesting(single, blobs, tmp_path_factory, data):
    depth = data.draw(st.sampled_from([17, 33, 100, 1000, 5000, 100_000]))
    where = data.draw(st.sampled_from(["graph", "manifest.json", "program metadata"]))
    if where == "graph":
        doc = msgpack.unpackb(data.draw(st.sampled_from(blobs)), raw=False)
        node = data.draw(st.sampled_from(doc["nodes"]))
        node["args"] = list(node.get("args") or []) + ["DEEP"]
        blob = msgpack.packb(doc, use_bin_type=True).replace(msgpack.packb("DEEP"), b"\x91" * depth + b"\x01", 1)
        expect_clean("deep nesting: graph", _load, blob)
        return
    root = tmp_path_factory.mktemp("deep") / "art"
    shutil.copytree(single, root)
    if where == "program metadata":
        where = json.loads((root / "manifest.json").read_text())["programs"][0]["meta"]
    doc = json.loads((root / where).read_text())
    key = data.draw(st.sampled_from(sorted(doc)))
    doc[key] = "DEEP"
    text = json.dumps(doc).replace('"DEEP"', "[" * depth + "]" * depth, 1)
    (root / where).write_text(text)
    _rehash(root)
    expect_clean(f"deep nesting: {where}", _open_and_bind, root)


SPECIAL = ["fifo", "dev-zero", "dev-urandom", "directory", "proc", "link-outside", "link-inside", "unreadable"]


def _make_special(path, how: str, root) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")
    elif how == "dev-urandom":
        path.symlink_to("/dev/urandom")
    elif how == "directory":
        path.mkdir()
    elif how == "proc":
        path.symlink_to("/proc/self/status")
    elif how == "link-outside":
        path.symlink_to("/etc/passwd")
    elif how == "link-inside":
        path.symlink_to(root / "manifest.json")
    else:
        path.write_bytes(b"{}")
        path.chmod(0)


@FUZZ
@given(data=st.data())
def test_special_files(single, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("special") / "art"
    shutil.copytree(single, root)
    rel = data.draw(st.sampled_from(sorted(json.loads((root / "manifest.json").read_text())["files"])))
    how = data.draw(st.sampled_from(SPECIAL))
    _make_special(root / rel, how, root)
    expect_clean(f"special file: {how}", _open_and_bind, root)
    if how != "link-inside":
        _make_special(root / "manifest.json", how, root)
        expect_clean(f"special manifest: {how}", _open_and_bind, root)


@FUZZ
@given(data=st.data())
def test_oversize_files(single, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("oversize") / "art"
    shutil.copytree(single, root)
    rel = data.draw(st.sampled_from(["manifest.json"] + sorted(json.loads((root / "manifest.json").read_text())["files"])))
    size = data.draw(st.sampled_from([(64 << 20) + 1, (1 << 30) + 1, 1 << 40]))
    with open(root / rel, "r+b") as f:
        f.truncate(size)  # sparse: as large as claimed, costing no disk
    expect_clean("oversize file", _open_and_bind, root)


# --- kernel plans ---------------------------------------------------------------------------------
PLAN_PEAK_BYTES = 32 << 20
"""Most a plan's decoding may allocate (its header is at most 256 KiB)."""
PLAN_PEAKS: list[int] = []
BIG = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 65535, 65536, 2**40, 2**40 + 1, 2**62, 2**63 - 1, -(2**63)])
PLAN_INT = st.one_of(st.integers(-(2**63), 2**63 - 1), BIG)


def _decode_bounded(data: bytes) -> None:
    """decode_plan under tracemalloc: what it allocates is recorded (asserted after the run)."""
    import tracemalloc

    from titan.runtime.kernels.kernel_plan import decode_plan

    tracemalloc.start()
    try:
        decode_plan(data)
    finally:
        PLAN_PEAKS.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def _seed_plan(data):
    """A valid plan of a few kernels and launches, as the recorder writes them."""
    from titan.runtime.kernels.kernel_plan import Kernel, Launch, Output, Plan

    n_kernels = data.draw(st.integers(1, 3))
    kernels = tuple(Kernel(name=f"triton_poi_fused_{i}", cubin=b"\x7fELF" + bytes(data.draw(st.integers(1, 64))),
                           shared=0, num_warps=4, arg_types="OOi") for i in range(n_kernels))
    launches = tuple(Launch(kernel=i, grid=(4, 1, 1), args=(("in", 0, 0, 4096), ("buf", 0, 0, 4096), 1024))
                     for i in range(n_kernels))
    return Plan(kernels=kernels, buffers=(4096,), inputs=1, launches=launches,
                outputs=(Output(base=("buf", 0), dtype="float32", size=(32, 32), stride=(32, 1), offset=0),
                         Output(base=("in", 0), dtype="float32", size=(1024,), stride=(1,), offset=0)))


def _plan_parts(data_bytes: bytes) -> tuple[dict, bytes]:
    from titan.runtime.kernels.kernel_plan import MAGIC

    size = int.from_bytes(data_bytes[len(MAGIC):len(MAGIC) + 4], "big")
    start = len(MAGIC) + 4
    return msgpack.unpackb(data_bytes[start:start + size], raw=False), data_bytes[start + size:]


def _plan_bytes(doc, cubins: bytes) -> bytes:
    from titan.runtime.kernels.kernel_plan import MAGIC

    header = msgpack.packb(doc, use_bin_type=True)
    return MAGIC + len(header).to_bytes(4, "big") + header + cubins


PLAN_FIELDS = {"launch": ["kernel", "grid", "args"], "kernel": ["name", "cubin_size", "shared", "num_warps", "arg_types"],
               "output": ["base", "dtype", "size", "stride", "offset"]}


@FUZZ
@given(data=st.data())
def test_hostile_kernel_plan_fields(data):
    # A crafted plan: every field a launch's reach depends on pushed to hostile values.
    from titan.runtime.kernels.kernel_plan import encode_plan

    doc, cubins = _plan_parts(encode_plan(_seed_plan(data)))
    how = data.draw(st.sampled_from(["grid", "pointer", "integer", "output", "buffers", "kernel", "counts", "junk"]))
    launch = data.draw(st.sampled_from(doc["launches"]))
    if how == "grid":
        launch["grid"] = data.draw(st.lists(PLAN_INT, min_size=0, max_size=4))
    elif how == "pointer":
        launch["args"][data.draw(st.integers(0, 1))] = [data.draw(st.sampled_from(["in", "buf", "host", "null"])),
                                                         data.draw(PLAN_INT), data.draw(PLAN_INT), data.draw(PLAN_INT)]
    elif how == "integer":
        launch["args"][2] = data.draw(st.one_of(PLAN_INT, JUNK))
    elif how == "output":
        out = data.draw(st.sampled_from(doc["outputs"]))
        field = data.draw(st.sampled_from(PLAN_FIELDS["output"]))
        out[field] = data.draw(st.one_of(PLAN_INT, st.lists(PLAN_INT, max_size=10), JUNK,
                                         st.sampled_from([["in", 0], ["buf", 0], ["in", 2**40], "float64", "object"])))
    elif how == "buffers":
        doc["buffers"] = data.draw(st.lists(PLAN_INT, max_size=6))
    elif how == "kernel":
        kernel = data.draw(st.sampled_from(doc["kernels"]))
        kernel[data.draw(st.sampled_from(PLAN_FIELDS["kernel"]))] = data.draw(st.one_of(
            PLAN_INT, JUNK, st.sampled_from(["O" * 300, "OOx", "a; import os", "__import__", ""])))
    elif how == "counts":  # more launches, kernels or outputs than a plan may have, or none
        key = data.draw(st.sampled_from(["launches", "kernels", "outputs"]))
        doc[key] = doc[key] * data.draw(st.sampled_from([0, 2, 600, 1100]))
    else:
        doc[data.draw(st.sampled_from(sorted(doc)))] = data.draw(JUNK)
    expect_clean(f"kernel plan: hostile {how}", _decode_bounded, _plan_bytes(doc, cubins))


def _mutate_bytes(blob: bytearray, how: str, data) -> bytearray:
    """One of the byte-level mutations the plan and record strategies share."""
    if how == "flip":
        for pos in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
            blob[pos] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        blob = blob[:data.draw(st.integers(0, len(blob) - 1))]
    elif how == "insert":
        pos = data.draw(st.integers(0, len(blob)))
        blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    return blob


@FUZZ
@given(data=st.data())
def test_kernel_plan_byte_level_mutations(data):
    from titan.runtime.kernels.kernel_plan import encode_plan

    blob = bytearray(encode_plan(_seed_plan(data)))
    how = data.draw(st.sampled_from(["flip", "truncate", "insert", "length"]))
    if how in ("flip", "truncate", "insert"):
        blob = _mutate_bytes(blob, how, data)
    else:  # the header length itself
        from titan.runtime.kernels.kernel_plan import MAGIC
        blob[len(MAGIC):len(MAGIC) + 4] = data.draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big")
    expect_clean(f"kernel plan bytes: {how}", _decode_bounded, bytes(blob))


@FUZZ
@given(data=st.data())
def test_kernel_plan_expansion_bombs(data):
    # Headers whose bytes would expand into many Python objects: empty containers, deep nesting,
    # long strings and maps, up to and past the header bound.
    from titan.runtime.kernels.kernel_plan import MAX_HEADER

    size = data.draw(st.sampled_from([1 << 10, 1 << 16, MAX_HEADER - 16, MAX_HEADER, MAX_HEADER + 1, 1 << 24]))
    kind = data.draw(st.sampled_from(["empty arrays", "empty maps", "nesting", "strings", "ints"]))
    unit = {"empty arrays": b"\x90", "empty maps": b"\x80", "nesting": b"\x91", "strings": b"\xa1a",
            "ints": b"\xcf" + b"\xff" * 8}[kind]
    count = max(1, (size - 5) // len(unit))
    header = b"\xdd" + count.to_bytes(4, "big") + unit * count if kind != "nesting" else unit * size
    where = data.draw(st.sampled_from(["top", "launches"]))
    if where == "launches":
        header = msgpack.packb({"inputs": 1, "kernels": [], "buffers": [], "outputs": [], "launches": "X"})
        header = header.replace(msgpack.packb("X"), b"\xdd" + count.to_bytes(4, "big") + unit * count)
    from titan.runtime.kernels.kernel_plan import MAGIC
    expect_clean(f"kernel plan bomb: {kind}", _decode_bounded, MAGIC + len(header).to_bytes(4, "big") + header)


def test_plan_decoding_memory_stayed_bounded():
    # Runs after the plan strategies (file order).
    if PLAN_PEAKS:
        print(f"fuzz kernel plans: {len(PLAN_PEAKS)} decoded, peak {max(PLAN_PEAKS) / 2**20:.1f} MiB allocated")
        assert max(PLAN_PEAKS) <= PLAN_PEAK_BYTES


# --- content-store records -------------------------------------------------------------------------
RECORD_PEAK_BYTES = 2 << 20
"""Most the reads of one example may allocate when its record file is small (the reader's 1 MiB
read buffer, then a hash): every mutation but an oversized or a signed large one."""
LARGE_RECORD_PEAK_BYTES = 8 * (4 << 20)
"""... and when it is up to MAX_RECORD_BYTES (4 MiB): today the chunks read, their join and the
body's slice (3 copies), then (signed only) its parsed value: a signed `[0,0,...]` of 4 MiB parses
to a 2M-item list (~28 MiB in all) before it is refused as not a record, as the density check
counts lists, objects and strings but not numbers."""
RECORD_PEAKS: dict[str, int] = {}
"""Per mutation, the most one example's reads allocated."""
RECORD_KIND = "entries"
SHA = st.text("0123456789abcdef", min_size=64, max_size=64)
RECORD_VALUE = st.recursive(st.one_of(JSON_JUNK, SHA), lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)
RECORD_NAME = st.from_regex(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,20}", fullmatch=True)
# "untouched" last: Hypothesis leans to a list's first element.
RECORD_MUTATIONS = ["flip", "truncate", "insert", "forged mac", "bad header", "signed junk", "oversized",
                    "renamed key", "renamed uid", "special", "untouched"]
BAD_HEADERS = [b"titan-record-v1 ", b"titan-record-v2", b"TITAN-RECORD-V2 ", b"titan-record-v3 ", b"",
               b"\xef\xbb\xbftitan-record-v2 ", b" titan-record-v2 "]


def _signed_junk(data) -> bytes:
    """A body signed with this user's key (what a bug, or a stolen key, could produce): the
    parse after authentication must still be bounded in depth, density and size."""
    from titan.runtime.store.record import MAX_RECORD_BYTES

    n = data.draw(st.sampled_from([10, 1000, 100_000, (MAX_RECORD_BYTES - 100) // 2]))
    return data.draw(st.sampled_from([
        b"[" * n + b"]" * n, b'{"a":' * n + b"0" + b"}" * n, b"[" + b"0," * n + b"0]", b"[" + b"[]," * (n // 2) + b"[]]",
        b'{"x":"' + b"a" * (2 * n) + b'"}', b"[" + b"{}," * (n // 2) + b"{}]", b"null", b"[]", b"1e999999",
        b'"\\ud800"', b"\xff\xfe", b"{\"a\": NaN}", b"{" + b'"k":0,' * (n // 3) + b'"k":1}']))


def _mutate_record(store, path, name: str, data) -> tuple[str, str, bytes | None]:
    """Change the genuine record file at `path` (of `name`) as an attacker or a fault could; the
    (how, name to read, the file's bytes if they may be served: untouched, or signed with this
    user's key; else None)."""
    from titan.runtime.store.record import HEADER, MAX_RECORD_BYTES
    from titan.runtime.store.signing import record_mac

    genuine = path.read_bytes()
    blob = bytearray(genuine)
    body = genuine[genuine.index(b"\n") + 1:]
    how = data.draw(st.sampled_from(RECORD_MUTATIONS))
    if how == "untouched":
        return how, name, genuine
    if how in ("flip", "truncate", "insert"):
        blob = _mutate_bytes(blob, how, data)
    elif how == "forged mac":
        mac = data.draw(st.one_of(SHA, st.sampled_from([record_mac(RECORD_KIND, name + "x", body),
                                                         record_mac("ranks", name, body), "0" * 64])))
        other = json.dumps(data.draw(RECORD_VALUE)).encode()
        blob = bytearray(HEADER + mac.encode() + b"\n" + data.draw(st.sampled_from([body, other])))
    elif how == "bad header":
        mac = genuine[len(HEADER):len(HEADER) + 64]
        mac = data.draw(st.sampled_from([mac, mac.upper(), mac[:63], mac + b"0", b""]))
        blob = bytearray(data.draw(st.sampled_from(BAD_HEADERS)) + mac
                         + data.draw(st.sampled_from([b"\n", b"\r\n", b" \n", b""])) + body)
    elif how == "signed junk":
        junk = _signed_junk(data)
        blob = HEADER + record_mac(RECORD_KIND, name, junk).encode() + b"\n" + junk
        path.write_bytes(blob)
        return how, name, blob  # signed with this user's key: served if it parses within bounds
    elif how == "oversized":
        size = data.draw(st.sampled_from([MAX_RECORD_BYTES, MAX_RECORD_BYTES + 1, 64 << 20, 1 << 40]))
        with open(path, "r+b") as f:
            f.truncate(size)  # sparse: the genuine header and body, then zeros
        return how, name, None
    elif how == "renamed key":
        other = data.draw(RECORD_NAME.filter(lambda n: n != name))
        os.replace(path, path.with_name(f"{other}@{store.uid}.json"))
        return how, other, None
    elif how == "renamed uid":
        uid = data.draw(st.sampled_from([u for u in (0, 1, 65534, store.uid + 1, 2 ** 32 - 1) if u != store.uid]))
        moved = path.with_name(f"{name}@{uid}.json")
        os.replace(path, moved)
        if data.draw(st.booleans()) and os.geteuid() == 0:
            os.chown(moved, uid, -1)  # owned as named: read as that user's own, unauthenticated
        return how, data.draw(st.sampled_from([name, f"{name}@{uid}"])), None
    else:
        special = data.draw(st.sampled_from(SPECIAL))
        _make_special(path, special, path.parent.parent)
        return f"special: {special}", name, None
    path.write_bytes(bytes(blob))
    if bytes(blob) == genuine:  # e.g. a byte flipped twice
        return "untouched", name, genuine
    return how, name, None


def _read_records(category: str, store, name: str) -> tuple[dict | None, str]:
    """What a build and a maintenance pass read of one kind's records, under tracemalloc."""
    import tracemalloc

    tracemalloc.start()
    try:
        state = store.record_state(RECORD_KIND, name)
        store.record_names(RECORD_KIND, strays=[])
        store.foreign_blob_refs()
        return state
    finally:
        RECORD_PEAKS[category] = max(RECORD_PEAKS.get(category, 0), tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def _record_outcome(category: str, store, name: str, servable: bytes | None) -> str:
    """Served unchanged (only a record this user's key signed at that name), refused with a
    reason, or a one-line StoreError; any other exception, or 5 s, fails."""
    from titan.runtime.store.content_store import StoreError

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(5)
    try:
        record, why = _read_records(category, store, name)
    except _Hang:
        pytest.fail("record read hung for over 5 s")
    except StoreError as e:
        assert str(e) and "\n" not in str(e), f"a StoreError is one line: {e!r}"
        return "rejected"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if record is not None:
        assert servable is not None and record == json.loads(servable[servable.index(b"\n") + 1:]), \
            f"{category}: served a record that was not genuine"
        return "accepted"
    assert category != "cache record: untouched", f"refused the untouched record: {why}"
    assert why and "\n" not in why, f"{category}: refused without a one-line reason: {why!r}"
    return "rejected"


def _expect_record_outcome(category: str, store, name: str, servable: bytes | None) -> None:
    outcome = _record_outcome(category, store, name, servable)
    OUTCOMES.setdefault(category, {"accepted": 0, "rejected": 0})[outcome] += 1
    _write_report()


@FUZZ
@given(data=st.data())
def test_cache_record_mutations(tmp_path_factory, data):
    from titan.runtime.store.content_store import ContentStore

    store = ContentStore(tmp_path_factory.mktemp("records") / "cache", record_kinds=(RECORD_KIND,))
    try:
        name = data.draw(RECORD_NAME)
        record = data.draw(st.dictionaries(st.text(max_size=8), RECORD_VALUE, min_size=1, max_size=6))
        store.put_record(RECORD_KIND, name, record)
        path = store.root / RECORD_KIND / f"{name}@{store.uid}.json"
        how, read_as, servable = _mutate_record(store, path, name, data)
        _expect_record_outcome(f"cache record: {how}", store, read_as, servable)
    finally:
        store.close()


def test_record_reading_memory_stayed_bounded():
    # Runs after the record strategy (file order).
    from titan.runtime.store.record import MAX_RECORD_BYTES

    assert LARGE_RECORD_PEAK_BYTES == 8 * MAX_RECORD_BYTES
    for category, peak in sorted(RECORD_PEAKS.items()):
        print(f"fuzz {category}: peak {peak / 2**20:.1f} MiB allocated")
    for category, peak in RECORD_PEAKS.items():
        large = category in ("cache record: oversized", "cache record: signed junk")
        assert peak <= (LARGE_RECORD_PEAK_BYTES if large else RECORD_PEAK_BYTES), category


def test_outcome_counts_are_reported():
    # Runs after the strategies above (file order); prints the counts for the closing note.
    for category, counts in sorted(OUTCOMES.items()):
        print(f"fuzz {category}: {counts['rejected']} rejected, {counts['accepted']} accepted, "
              f"0 crashes, 0 hangs, {len(CANARY_CALLS)} code executions")
    assert sum(c["rejected"] for c in OUTCOMES.values()) > 0

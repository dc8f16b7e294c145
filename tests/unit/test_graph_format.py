"""The graph format loads only allow-listed ops and well-formed node lists."""

from __future__ import annotations

import msgpack
import pytest
import torch

from titan.runtime.contract.graph_decode import VERSION, GraphFormatError, load_graph


def _blob(nodes, **extra) -> bytes:
    return msgpack.packb({"format": "titan-graph", "version": VERSION, "nodes": nodes, "constants": None, **extra},
                         use_bin_type=True)


def _load(blob: bytes):
    return load_graph(blob, device=torch.device("cpu"), groups={"tp": "0"})


def _mm_graph(target="aten.mm.default", ref=0):
    return [
        {"name": "a", "op": "placeholder"},
        {"name": "b", "op": "placeholder"},
        {"name": "c", "op": "call_function", "target": target, "args": [{"$n": ref}, {"$n": 1}], "kwargs": {}},
        {"name": "output", "op": "output", "args": [{"$t": [{"$n": 2}]}]},
    ]


def test_well_formed_graph_runs():
    gm = _load(_blob(_mm_graph()))
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    (out,) = gm(a, b)
    assert torch.equal(out, a @ b)


@pytest.mark.parametrize("target", ["builtins.eval", "os.system", "aten.from_file.default", "subprocess.run.x",
                                    "torch.load", "aten.mm"])
def test_targets_outside_the_allow_list_are_refused(target):
    with pytest.raises(GraphFormatError):
        _load(_blob(_mm_graph(target=target)))


@pytest.mark.parametrize("ref", [2, 3, -1, "0"])
def test_forward_or_dangling_references_are_refused(ref):
    with pytest.raises(GraphFormatError):
        _load(_blob(_mm_graph(ref=ref)))


def test_unknown_process_group_is_refused():
    nodes = [
        {"name": "a", "op": "placeholder"},
        {"name": "r", "op": "call_function", "target": "_c10d_functional.all_reduce.default",
         "args": [{"$n": 0}, "sum", {"$group": "dp_shard"}], "kwargs": {}},
        {"name": "output", "op": "output", "args": [{"$t": [{"$n": 1}]}]},
    ]
    with pytest.raises(GraphFormatError, match="dp_shard"):
        _load(_blob(nodes))


@pytest.mark.parametrize("blob", [b"", b"\x00\x01garbage", msgpack.packb([1, 2, 3]),
                                  msgpack.packb({"format": "titan-graph", "version": 99, "nodes": []})])
def test_malformed_blobs_are_refused(blob):
    with pytest.raises(GraphFormatError):
        _load(blob)


@pytest.mark.parametrize("target", ["aten._unsafe_index.Tensor", "aten._unsafe_index_put.default",
                                    "aten._unsafe_masked_index.default", "aten.as_strided.default",
                                    "aten.index_select.default", "aten.empty.memory_format", "prims.as_strided.default"])
def test_ops_titan_never_emits_are_refused_even_if_safe_looking(target):
    with pytest.raises(GraphFormatError, match="allow-list"):
        _load(_blob(_mm_graph(target=target)))


def test_allow_list_has_no_memory_unsafe_op():
    # That it covers every op titan builds: e2e/test_op_allowlist.py.
    from titan.runtime.contract.op_allowlist import ALLOWED_OPS

    assert not {op for op in ALLOWED_OPS if "_unsafe_" in op} - {"aten._unsafe_view.default"}
    assert not {op for op in ALLOWED_OPS if op.split(".")[1] in ("as_strided", "set_", "from_file", "resize_")}


def _tagged(region):
    nodes = _mm_graph()
    nodes[2]["region"] = region
    return _blob(nodes)


def test_region_tags_only_of_the_fusion_pass_the_graph_was_built_with():
    gm = load_graph(_tagged("exact#0"), device=torch.device("cpu"), groups={}, regions=frozenset({"exact"}))
    assert [n.meta.get("titan_region") for n in gm.graph.nodes] == [None, None, "exact#0", None]
    for region, allowed in (("exact#0", frozenset()), ("block#3", frozenset({"exact"})), ("exact", frozenset({"exact"})),
                            (["exact#0"], frozenset({"exact"}))):
        with pytest.raises(GraphFormatError, match="region"):
            load_graph(_tagged(region), device=torch.device("cpu"), groups={}, regions=allowed)


@pytest.mark.parametrize("depth", [40, 5000])
def test_deeply_nested_values_are_refused(depth):
    nodes = _mm_graph()
    nodes[2]["args"] = [{"$n": 0}, "DEEP"]
    # msgpack will not pack thousands of levels: splice them in as raw bytes (fixarray of 1).
    blob = _blob(nodes).replace(msgpack.packb("DEEP"), b"\x91" * depth + b"\x01")
    with pytest.raises(GraphFormatError):
        _load(blob)


@pytest.mark.parametrize("dim", [8, -9, 1 << 20])
def test_dimension_arguments_are_bounded(dim):
    nodes = [
        {"name": "a", "op": "placeholder"},
        {"name": "s", "op": "call_function", "target": "aten.unsqueeze.default", "args": [{"$n": 0}, dim], "kwargs": {}},
        {"name": "output", "op": "output", "args": [{"$t": [{"$n": 1}]}]},
    ]
    with pytest.raises(GraphFormatError, match="dimension"):
        _load(_blob(nodes))


def test_every_sized_argument_of_every_allowed_op_has_a_meaning():
    """Each int, int-list and number argument of an allowed op is bounded by what it means (a
    shape, a split list, a dimension, ...): an op added to the allow-list with an argument the
    loader cannot classify fails here, not in a user's run."""
    from titan.runtime.contract.arg_bounds import BOUNDED_KINDS, meaning_of, plain_kind
    from titan.runtime.contract.graph_decode import resolve_target
    from titan.runtime.contract.op_allowlist import ALLOWED_OPS

    sized = 0
    for name in sorted(ALLOWED_OPS):
        for arg in resolve_target(name)._schema.arguments:
            if plain_kind(str(arg.real_type)) in BOUNDED_KINDS:
                assert meaning_of(arg.name, str(arg.real_type)) is not None, (name, arg.name)
                sized += 1
    assert sized > 60


def _call_graph(target: str, args: list, kwargs: dict | None = None) -> bytes:
    return _blob([
        {"name": "a", "op": "placeholder"},
        {"name": "c", "op": "call_function", "target": target, "args": args, "kwargs": kwargs or {}},
        {"name": "output", "op": "output", "args": [{"$t": [{"$n": 1}]}]},
    ])


def _all_to_all(splits: list[int]) -> bytes:
    return _call_graph("_c10d_functional.all_to_all_single.default",
                       [{"$n": 0}, splits, splits, {"$group": "tp"}])


@pytest.mark.parametrize("parts", [2, 4, 8, 64])
def test_split_sizes_are_bounded_by_their_sum_not_their_product(parts):
    """DeepSeek-V3's dispatch at ep 4 sends [512] * 4 rows (a product of 2^36, a sum of 2,048):
    issue 32, every artifact above ep 2 was refused."""
    _load(_all_to_all([512] * parts))


@pytest.mark.parametrize("splits,why", [([1 << 32, 1 << 32, 1], "add up to"), ([4, -1], "split size -1"),
                                        ([1] * ((1 << 16) + 1), "split sizes")])
def test_split_lists_out_of_bounds_are_refused(splits, why):
    with pytest.raises(GraphFormatError, match=why):
        _load(_all_to_all(splits))


@pytest.mark.parametrize("target,args,why", [
    # 2^34 elements (64-128 GiB) from one node: a shape's product, an arange's length
    ("aten.new_zeros.default", [{"$n": 0}, [1 << 17, 1 << 17]], "elements"),
    ("aten.expand.default", [{"$n": 0}, [1 << 17, 1 << 17]], "elements"),
    ("aten.slice_backward.default", [{"$n": 0}, [1 << 17, 1 << 17], 0, 0, 1, 1], "elements"),
    ("aten.arange.default", [1 << 34], "elements"),
    ("aten.arange.start_step", [-(1 << 33), 1 << 33, 1], "elements"),
    ("aten.arange.start_step", [0, 10, 0], "non-zero step"),
    ("aten.arange.start_step", [-1e308, 1e308, 1e-300], "non-zero step"),
    ("aten.embedding_dense_backward.default", [{"$n": 0}, {"$n": 0}, 1 << 34, -1, False], "count"),
    ("aten.view.default", [{"$n": 0}, [1] * 9], "dimensions"),
    ("aten.constant_pad_nd.default", [{"$n": 0}, [1, 2, 3]], "padding"),
    ("aten.sum.dim_IntList", [{"$n": 0}, [0, 9]], "dimension 9"),
    ("aten.nll_loss_forward.default", [{"$n": 0}, {"$n": 0}, None, 7, -100], "reduction"),
])
def test_sizes_are_bounded_by_what_they_mean(target, args, why):
    with pytest.raises(GraphFormatError, match=why):
        _load(_call_graph(target, args))


def test_shapes_and_splits_within_their_meaning_load():
    for target, args in (("aten.new_zeros.default", [{"$n": 0}, [1 << 16, 1 << 16]]),
                         ("aten.view.default", [{"$n": 0}, [-1, 4096]]),
                         ("aten.split_with_sizes.default", [{"$n": 0}, [0, 1 << 20, 3], 1]),
                         ("aten.constant_pad_nd.default", [{"$n": 0}, [0, 1, -1, 0]])):
        _load(_call_graph(target, args))


def test_a_recorded_result_over_the_node_bound_is_refused():
    nodes = _mm_graph()
    nodes[2]["val"] = {"shape": [1 << 17, 1 << 17], "stride": [1 << 17, 1], "dtype": "float32"}
    with pytest.raises(GraphFormatError, match="elements"):
        _load(_blob(nodes))

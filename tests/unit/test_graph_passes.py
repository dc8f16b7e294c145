"""Each graph pass on small hand-built FX graphs (real aten and functional-collective ops, fake
values), with the resulting graph asserted node by node. The end-to-end effect of the passes on
built artifacts is in test_passes.py; their numerics in test_layouts_bitwise.py."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.descriptors import ParamAOTInput, PlainAOTInput, PlainAOTOutput, TangentAOTInput
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from titan.builder.passes.bucketing import bucket_all_gather_pass, bucket_reduce_scatter_pass
from titan.builder.passes.checkpointing import tag_activation_checkpointing
from titan.builder.passes.embedding_mask import mask_index_put_to_where_pass
from titan.builder.passes.overlap import overlap_collectives_pass
from titan.builder.models import model_spec
from titan.builder.passes.registry import PassContext
from titan.builder.passes.regions import fuse_blocks_pass, fuse_exact_pass, fuse_regions_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MESH_DIMS = {"dp": "dp_shard", "tp": "tp"}
"""Process-group name -> mesh dimension, as the tracer gives it to the passes."""
LLAMA3 = model_spec("llama3")
"""The graphs name their modules as Llama 3's (blocks are 'layers.N')."""


def context(graph: str = "forward", *, input_names=(), output_names=()) -> PassContext:
    return PassContext(graph=graph, model=LLAMA3, mesh_dims=MESH_DIMS, input_names=list(input_names),
                       output_names=list(output_names))


class HandGraph:
    """An FX graph built node by node; each node's fake value is computed from its inputs' and
    `module` records the module that produced it, as the tracer's provenance hooks do."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()

    def input(self, name: str, shape, dtype=torch.float32, *, desc=None) -> fx.Node:
        n = self.graph.placeholder(name)
        with self.mode:
            n.meta["val"] = torch.empty(shape, dtype=dtype)
        if desc is not None:
            n.meta["desc"] = desc
        return n

    def __call__(self, target, *args, module: str | None = None, **kwargs) -> fx.Node:
        n = self.graph.call_function(target, args, kwargs)
        with self.mode:
            n.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]),
                                   **fx.node.map_arg(kwargs, lambda a: a.meta["val"]))
        if module is not None:
            n.meta["custom"] = {"module": module}
        return n

    def collective(self, target, x: fx.Node, *args, module: str) -> fx.Node:
        """A functional collective and its wait; returns the wait."""
        return self(c10d.wait_tensor.default, self(target, x, *args, module=module), module=module)

    def finish(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _op(n: fx.Node) -> str:
    if n.target is operator.getitem:
        return "getitem"
    return str(n.target).removeprefix("aten.").removeprefix("_c10d_functional.").removesuffix(".default")


def _names(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Placeholders keep their names; computing nodes are named by op and order of appearance
    (view, view_1, ...), independent of how the torch version names nodes."""
    names, seen = {}, {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = n.name
        elif n.op == "call_function":
            base = _op(n).split(".")[0]
            names[n] = base if base not in seen else f"{base}_{seen[base]}"
            seen[base] = seen.get(base, 0) + 1
    return names


def listing(gm: fx.GraphModule) -> str:
    """One line per computing node, in graph order: 'name = op(args)'."""
    names = _names(gm)

    def arg(a):
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        return names[a] if isinstance(a, fx.Node) else repr(a)

    return "\n".join(f"{names[n]} = {_op(n)}({', '.join(arg(a) for a in n.args)}"
                     + "".join(f", {k}={arg(v)}" for k, v in n.kwargs.items()) + ")"
                     for n in gm.graph.nodes if n.op == "call_function")


def expected(text: str) -> str:
    """A listing as a test writes it out: one node a line; '#' lines are comments."""
    return "\n".join(line.strip() for line in text.strip().splitlines() if not line.strip().startswith("#"))


def output_names(gm: fx.GraphModule) -> list[str]:
    names = _names(gm)
    return [names[n] for n in next(n for n in gm.graph.nodes if n.op == "output").args[0]]


# -- FSDP bucketing -----------------------------------------------------------------------------


def _fsdp_forward() -> tuple[fx.GraphModule, PassContext]:
    """Three parameter shards all-gathered over dp (two of block layers.0, one of layers.1) and
    a tensor-parallel all-gather of the activations, which is not FSDP's."""
    g = HandGraph()
    w0, w1, w2, x = g.input("w0", (4, 8)), g.input("w1", (2,)), g.input("w2", (4, 8)), g.input("x", (3, 8))
    wq = g.collective(c10d.all_gather_into_tensor.default, w0, 2, "dp", module="layers.0.attention.wq")
    norm = g.collective(c10d.all_gather_into_tensor.default, w1, 2, "dp", module="layers.0.attention_norm")
    xs = g.collective(c10d.all_gather_into_tensor.default, x, 2, "tp", module="layers.0.attention")
    y = g(aten.mm.default, xs, g(aten.t.default, wq, module="layers.0.attention.wq"), module="layers.0.attention.wq")
    z = g(aten.mul.Tensor, y, g(aten.sum.default, norm, module="layers.0.attention_norm"),
          module="layers.0.attention_norm")
    wq1 = g.collective(c10d.all_gather_into_tensor.default, w2, 2, "dp", module="layers.1.attention.wq")
    out = g(aten.mm.default, z, wq1, module="layers.1.attention.wq")
    ctx = context(input_names=["p0", "p1", "p2", None])
    return g.finish(out), ctx


def test_bucket_all_gather_merges_a_blocks_fsdp_gathers_into_one_on_a_flat_buffer():
    gm, ctx = _fsdp_forward()
    gm = bucket_all_gather_pass(gm, ctx=ctx)
    assert listing(gm) == expected("""
        # Block layers.0: both shards flattened into one buffer, gathered once...
        view = view(w0, [-1])
        view_1 = view(w1, [-1])
        cat = cat([view, view_1])
        all_gather_into_tensor = all_gather_into_tensor(cat, 2, 'dp')
        wait_tensor = wait_tensor(all_gather_into_tensor)
        # ...then each parameter's columns (32 and 2 elements per rank) copied out and viewed whole.
        view_2 = view(wait_tensor, [2, 34])
        slice = slice.Tensor(view_2, 1, 0, 32)
        clone = clone(slice, memory_format=torch.contiguous_format)
        view_3 = view(clone, [8, 8])
        slice_1 = slice.Tensor(view_2, 1, 32, 34)
        clone_1 = clone(slice_1, memory_format=torch.contiguous_format)
        view_4 = view(clone_1, [4])
        # The tensor-parallel gather is not FSDP's: untouched.
        all_gather_into_tensor_1 = all_gather_into_tensor(x, 2, 'tp')
        wait_tensor_1 = wait_tensor(all_gather_into_tensor_1)
        t = t(view_3)
        mm = mm(wait_tensor_1, t)
        sum = sum(view_4)
        mul = mul.Tensor(mm, sum)
        # Block layers.1 has one parameter: nothing to merge.
        all_gather_into_tensor_2 = all_gather_into_tensor(w2, 2, 'dp')
        wait_tensor_2 = wait_tensor(all_gather_into_tensor_2)
        mm_1 = mm(mul, wait_tensor_2)
        """)
    assert [b.to_json() for b in ctx.plan] == [
        {"graph": "forward", "kind": "all_gather", "group": "dp_shard", "block": "layers.0", "params": ["p0", "p1"],
         "elements": 34, "dtype": "float32", "bytes": 2 * 34 * 4},
        {"graph": "forward", "kind": "all_gather", "group": "dp_shard", "block": "layers.1", "params": ["p2"],
         "elements": 32, "dtype": "float32", "bytes": 2 * 32 * 4},
    ]


def test_bucket_reduce_scatter_merges_a_blocks_gradient_reductions_into_one():
    g = HandGraph()
    a, b = g.input("a", (8, 8)), g.input("b", (4,))
    grad0 = g(aten.mul.Tensor, a, 2.0, module="layers.0.attention.wq")
    grad1 = g(aten.mul.Tensor, b, 3.0, module="layers.0.attention_norm")
    out0 = g.collective(c10d.reduce_scatter_tensor.default, grad0, "sum", 2, "dp", module="layers.0.attention.wq")
    out1 = g.collective(c10d.reduce_scatter_tensor.default, grad1, "sum", 2, "dp", module="layers.0.attention_norm")
    gm = g.finish(out0, out1)
    ctx = context("backward", output_names=["p0", "p1"])
    gm = bucket_reduce_scatter_pass(gm, ctx=ctx)
    assert listing(gm) == expected("""
        mul = mul.Tensor(a, 2.0)
        mul_1 = mul.Tensor(b, 3.0)
        # Each gradient as (ranks, elements per rank), side by side: rank r's columns are
        # contiguous, so one reduce-scatter gives each rank its slice of every gradient.
        view = view(mul, [2, 32])
        view_1 = view(mul_1, [2, 2])
        cat = cat([view, view_1], 1)
        view_2 = view(cat, [68])
        reduce_scatter_tensor = reduce_scatter_tensor(view_2, 'sum', 2, 'dp')
        wait_tensor = wait_tensor(reduce_scatter_tensor)
        slice = slice.Tensor(wait_tensor, 0, 0, 32)
        view_3 = view(slice, [4, 8])
        slice_1 = slice.Tensor(wait_tensor, 0, 32, 34)
        view_4 = view(slice_1, [2])
        """)
    assert output_names(gm) == ["view_3", "view_4"]
    assert [(b.kind, b.block, b.params, b.elements) for b in ctx.plan] == [
        ("reduce_scatter", "layers.0", ("p0", "p1"), 34)]


# -- Overlap ------------------------------------------------------------------------------------


def overlapped(gm: fx.GraphModule, graph: str = "forward") -> str:
    return listing(overlap_collectives_pass(gm, ctx=context(graph)))


def test_overlap_issues_a_collective_before_independent_compute_and_waits_at_first_use():
    g = HandGraph()
    x, w, dy = g.input("x", (4, 8)), g.input("w", (8, 8)), g.input("dy", (4, 8))
    weight_grad = g(aten.mm.default, g(aten.t.default, dy), x)        # does not feed the collective
    partial = g(aten.mm.default, dy, w)                                # does
    scattered = g.collective(c10d.reduce_scatter_tensor.default, partial, "sum", 2, "tp", module="layers.0")
    scaled = g(aten.mul.Tensor, weight_grad, 0.5)
    assert overlapped(g.finish(g(aten.add.Tensor, scattered, 1.0), scaled), "backward") == expected("""
        mm = mm(dy, w)
        reduce_scatter_tensor = reduce_scatter_tensor(mm, 'sum', 2, 'tp')
        # The weight-gradient matmul and everything else independent runs under the collective.
        t = t(dy)
        mm_1 = mm(t, x)
        mul = mul.Tensor(mm_1, 0.5)
        wait_tensor = wait_tensor(reduce_scatter_tensor)
        add = add.Tensor(wait_tensor, 1.0)
        """)


def test_overlap_gathers_fsdp_parameters_one_block_ahead():
    g = HandGraph()
    w0, w1, x = g.input("w0", (4, 8)), g.input("w1", (4, 8)), g.input("x", (8, 8))
    full0 = g.collective(c10d.all_gather_into_tensor.default, w0, 2, "dp", module="layers.0")
    h = g(aten.relu.default, g(aten.mm.default, x, full0))
    full1 = g.collective(c10d.all_gather_into_tensor.default, w1, 2, "dp", module="layers.1")
    assert overlapped(g.finish(g(aten.mm.default, h, full1))) == expected("""
        all_gather_into_tensor = all_gather_into_tensor(w0, 2, 'dp')
        wait_tensor = wait_tensor(all_gather_into_tensor)
        # Block 1's gather is issued as soon as block 0's has arrived, while block 0 computes.
        all_gather_into_tensor_1 = all_gather_into_tensor(w1, 2, 'dp')
        mm = mm(x, wait_tensor)
        relu = relu(mm)
        wait_tensor_1 = wait_tensor(all_gather_into_tensor_1)
        mm_1 = mm(relu, wait_tensor_1)
        """)


def test_overlap_keeps_one_collective_per_group_outstanding():
    g = HandGraph()
    a, b = g.input("a", (4, 8)), g.input("b", (4, 8))
    first = g.collective(c10d.all_reduce.default, a, "sum", "tp", module="layers.0")
    second = g.collective(c10d.all_reduce.default, b, "sum", "tp", module="layers.0")
    # The first wait could move down to the add, but not past the next all-reduce on its group.
    assert overlapped(g.finish(g(aten.add.Tensor, first, second))) == expected("""
        all_reduce = all_reduce(a, 'sum', 'tp')
        wait_tensor = wait_tensor(all_reduce)
        all_reduce_1 = all_reduce(b, 'sum', 'tp')
        wait_tensor_1 = wait_tensor(all_reduce_1)
        add = add.Tensor(wait_tensor, wait_tensor_1)
        """)


# -- The embedding mask -------------------------------------------------------------------------


def test_mask_index_put_becomes_where_and_accumulating_index_put_stays():
    g = HandGraph()
    x, mask, fill = g.input("x", (4, 8)), g.input("mask", (4,), torch.bool), g.input("fill", ())
    masked = g(aten.index_put.default, x, [mask], fill)
    summed = g(aten.index_put.default, x, [mask], fill, True)
    gm = mask_index_put_to_where_pass(g.finish(masked, summed), ctx=context())
    assert listing(gm) == expected("""
        # The mask broadcast over the row: no nonzero(), so no host sync.
        view = view(mask, [4, 1])
        where = where.self(view, fill, x)
        index_put = index_put(x, [mask], fill, True)
        """)
    assert output_names(gm) == ["where", "index_put"]


# -- Fusion regions -----------------------------------------------------------------------------


def regions(gm: fx.GraphModule) -> list[str]:
    names = _names(gm)
    return [f"{names[n]}: {n.meta['titan_region']}" for n in gm.graph.nodes if "titan_region" in n.meta]


def test_fuse_exact_groups_exact_elementwise_chains_into_convex_regions():
    g = HandGraph()
    x, w = g.input("x", (4, 8)), g.input("w", (8, 8))
    a1 = g(aten.mul.Tensor, x, 2.0)
    other = g(aten.mm.default, x, w)                     # independent: moves out of the region's way
    a2 = g(aten.add.Tensor, a1, 1.0)
    total = g(aten.sum.dim_IntList, a2, [-1], True)      # a reduction: never exact
    c1 = g(aten.mul.Tensor, a2, total)                     # joining a1/a2 would make a cycle through the sum
    c2 = g(aten.add.Tensor, c1, 1.0)
    lone = g(aten.neg.default, g(aten.mm.default, c2, w))  # a single op is not worth a kernel
    gm = fuse_exact_pass(g.finish(lone, other), ctx=context())
    assert regions(gm) == ["mul: exact#0", "add: exact#0", "mul_1: exact#1", "add_1: exact#1"]
    assert listing(gm) == expected("""
        mul = mul.Tensor(x, 2.0)
        add = add.Tensor(mul, 1.0)
        mm = mm(x, w)
        sum = sum.dim_IntList(add, [-1], True)
        mul_1 = mul.Tensor(add, sum)
        add_1 = add.Tensor(mul_1, 1.0)
        mm_1 = mm(add_1, w)
        neg = neg(mm_1)
        """)


def test_fuse_exact_makes_each_region_consecutive():
    g = HandGraph()
    x, w = g.input("x", (4, 8)), g.input("w", (8, 8))
    a = g(aten.mul.Tensor, x, 2.0)
    m = g(aten.mm.default, x, w)          # independent of a: may move out of the way
    b = g(aten.add.Tensor, a, 1.0)
    gm = fuse_exact_pass(g.finish(b, m), ctx=context())
    assert listing(gm) == expected("""
        mul = mul.Tensor(x, 2.0)
        add = add.Tensor(mul, 1.0)
        mm = mm(x, w)
        """)
    assert regions(gm) == ["mul: exact#0", "add: exact#0"]


def test_a_large_dtype_cast_alone_is_a_region_and_a_small_one_or_a_lone_op_is_not():
    # The weight gradient's cast (bf16 -> fp32 after its matmul) and the parameter's (fp32 ->
    # bf16 before one): each the only exact op between matmuls and outputs.
    g = HandGraph()
    x = g.input("x", (1024, 2048), torch.bfloat16)
    w = g.input("w", (1024, 1024))
    small = g.input("small", (1024,))
    grad = g(aten._to_copy.default, g(aten.t.default, g(aten.mm.default, g(aten.t.default, x), x)), dtype=torch.float32)
    weight = g(aten.t.default, g(aten._to_copy.default, w, dtype=torch.bfloat16))
    y = g(aten.mm.default, g(aten.t.default, x), weight)
    norm_weight = g(aten._to_copy.default, small, dtype=torch.bfloat16)  # 1,024 elements: ATen's copy is fine
    same_dtype = g(aten.clone.default, w)                                  # not a cast: one op, no region
    gm = fuse_exact_pass(g.finish(grad, y, norm_weight, same_dtype), ctx=context())
    # The casts with the views beside them; the small cast and the lone clone stay on ATen.
    assert regions(gm) == ["t_1: exact#0", "_to_copy: exact#0", "_to_copy_1: exact#1", "t_2: exact#1"]


def test_exact_regions_that_would_need_each_other_are_split_until_they_can_be_ordered():
    # Two groups, each convex alone, where each needs the other's output through a reduction
    # (as RMSNorm's recomputed forward and its backward do): run as two units they would
    # deadlock, so the pass must split one, and the graph must compute the same values.
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(aten.mul.Tensor, (x, x))
    b = g.call_function(aten.mul.Tensor, (a, x))
    c = g.call_function(aten.sum.dim_IntList, (b, [0], True))
    d = g.call_function(aten.add.Tensor, (y, y))
    e = g.call_function(aten.mul.Tensor, (d, c))
    f = g.call_function(aten.mul.Tensor, (d, y))
    s = g.call_function(aten.sum.dim_IntList, (f, [0], True))
    h = g.call_function(aten.mul.Tensor, (a, s))
    k = g.call_function(aten.add.Tensor, (h, b))
    g.output((e, k))
    gm = fx.GraphModule(torch.nn.Module(), g)
    inputs = (torch.randn(4, 3), torch.randn(4, 3))
    want = gm(*inputs)
    fuse_exact_pass(gm, ctx=None)
    tags = [n.meta.get("titan_region") for n in gm.graph.nodes]
    runs = [t for i, t in enumerate(tags) if t and (i == 0 or tags[i - 1] != t)]
    assert runs and len(runs) == len(set(runs))  # every region consecutive: one call each
    got = gm(*inputs)
    assert all(torch.equal(u, v) for u, v in zip(got, want))


def _two_blocks() -> fx.GraphModule:
    """RMSNorm -> matmul -> SwiGLU-style product in block 0, then RMSNorm in block 1."""
    g = HandGraph()
    x, w = g.input("x", (4, 8)), g.input("w", (8, 8))
    norm0 = "layers.0.attention_norm"
    sq = g(aten.pow.Tensor_Scalar, x, 2, module=norm0)
    rms = g(aten.rsqrt.default, g(aten.mean.dim, sq, [-1], True, module=norm0), module=norm0)
    normed = g(aten.mul.Tensor, x, rms, module=norm0)
    h = g(aten.mm.default, normed, w, module="layers.0.feed_forward.w1")
    act = g(aten.mul.Tensor, g(aten.silu.default, h, module="layers.0.feed_forward"), h,
            module="layers.0.feed_forward")
    res = g(aten.add.Tensor, act, x, module="layers.0")
    norm1 = "layers.1.attention_norm"
    out = g(aten.mul.Tensor, res, g(aten.rsqrt.default, g(aten.mean.dim, res, [-1], True, module=norm1),
                                    module=norm1), module=norm1)
    return g.finish(out)


def test_fuse_regions_makes_one_region_per_norm_and_swiglu_instance():
    gm = fuse_regions_pass(_two_blocks(), ctx=context())
    # The residual add belongs to no fused module kind: it stays out.
    assert regions(gm) == ["pow: rms_norm#0", "mean: rms_norm#0", "rsqrt: rms_norm#0", "mul: rms_norm#0",
                           "silu: swiglu#1", "mul_1: swiglu#1",
                           "mean_1: rms_norm#2", "rsqrt_1: rms_norm#2", "mul_2: rms_norm#2"]


def test_fuse_blocks_spans_module_boundaries_within_a_block():
    gm = fuse_blocks_pass(_two_blocks(), ctx=context())
    assert regions(gm) == ["pow: block#0", "mean: block#0", "rsqrt: block#0", "mul: block#0",
                           "silu: block#1", "mul_1: block#1", "add: block#1",
                           "mean_1: block#2", "rsqrt_1: block#2", "mul_2: block#2"]



def test_fuse_blocks_places_nodes_without_a_module_in_a_neighbouring_block():
    # Autograd's gradient sums carry no module: such a node joins the block of an input that has
    # one, else of a user that has one; with neither it stays out (a one-op region is no kernel).
    g = HandGraph()
    x, w = g.input("x", (4, 8)), g.input("w", (8, 8))
    a = g(aten.mul.Tensor, x, x, module="layers.0.feed_forward")
    b = g(aten.mul.Tensor, x, 2.0, module="layers.0.feed_forward")
    summed = g(aten.add.Tensor, a, b)                                # joins layers.0 through its inputs
    h = g(aten.mm.default, summed, w, module="layers.0.feed_forward.w2")
    early = g(aten.add.Tensor, h, h)                                 # joins layers.1 through its user
    late = g(aten.mul.Tensor, early, x, module="layers.1.attention_norm")
    lone = g(aten.neg.default, g(aten.mm.default, late, w, module="layers.1.attention.wq"))
    gm = fuse_blocks_pass(g.finish(lone, late), ctx=context())
    assert regions(gm) == ["mul: block#0", "mul_1: block#0", "add: block#0", "add_1: block#1", "mul_2: block#1"]


# -- Activation checkpointing tags --------------------------------------------------------------


def _joint() -> fx.GraphModule:
    """Forward of two blocks and the output, and a backward fed by the loss tangent."""
    g = HandGraph()
    w = g.input("w", (8, 8), desc=ParamAOTInput(target="layers.0.w"))
    x = g.input("x", (4, 8), desc=PlainAOTInput(idx=0))
    tangent = g.input("tangent", (), desc=TangentAOTInput(output=PlainAOTOutput(idx=0)))
    h = g(aten.relu.default, g(aten.mm.default, x, w, module="layers.0.ffn"), module="layers.0.ffn")
    h = g(aten.mul.Tensor, h, 2.0, module="layers.7.attention")
    loss = g(aten.sum.default, h, module="output")
    grad = g(aten.mul.Tensor, h, tangent, module="layers.0.ffn")   # backward: never tagged
    return g.finish(loss, grad)


def _tags(gm: fx.GraphModule) -> dict[str, tuple]:
    names = _names(gm)
    return {names[n]: (n.meta["recompute"], n.meta["ac_graph_id"]) for n in gm.graph.nodes if "recompute" in n.meta}


def test_full_ac_tags_every_forward_block_node_for_recompute_with_its_block():
    gm = _joint()
    assert tag_activation_checkpointing(gm, "full", ac_block=LLAMA3.ac_block) == 3
    recompute = CheckpointPolicy.PREFER_RECOMPUTE
    assert _tags(gm) == {"mm": (recompute, 0), "relu": (recompute, 0), "mul": (recompute, 7)}


def test_selective_ac_saves_matmuls_and_recomputes_the_rest():
    gm = _joint()
    assert tag_activation_checkpointing(gm, "selective", ac_block=LLAMA3.ac_block) == 2
    recompute = CheckpointPolicy.PREFER_RECOMPUTE
    assert _tags(gm) == {"mm": (CheckpointPolicy.MUST_SAVE, 0), "relu": (recompute, 0), "mul": (recompute, 7)}


def test_no_ac_tags_nothing():
    gm = _joint()
    assert tag_activation_checkpointing(gm, "none", ac_block=LLAMA3.ac_block) == 0 and _tags(gm) == {}


# -- the parameters' casts ----------------------------------------------------------------------


def test_fold_param_casts_takes_each_parameter_as_its_one_cast_and_leaves_the_rest():
    """w (cast twice to bf16, a tied weight) and n (cast once) are taken as their bf16 copies;
    left: v (also read as fp32), s (its cast feeds an FSDP all-gather), the buffer b (not a
    parameter) and f (cast to fp16 and to bf16)."""
    from titan.builder.passes.param_casts import fold_param_casts_pass

    g = HandGraph()
    w, n, v, s, b, f, x = (g.input("w", (8, 8)), g.input("n", (8,)), g.input("v", (8, 8)), g.input("s", (4, 8)),
                           g.input("b", (8,)), g.input("f", (8, 8)), g.input("x", (3, 8), torch.bfloat16))
    bf16 = dict(dtype=torch.bfloat16)
    y = g(aten.mm.default, x, g(aten._to_copy.default, w, **bf16))
    y = g(aten.mul.Tensor, y, g(aten._to_copy.default, n, **bf16))
    y = g(aten.mm.default, y, g(aten._to_copy.default, w, **bf16))
    y = g(aten.add.Tensor, g(aten.mm.default, y, g(aten._to_copy.default, v, **bf16)), g(aten.sum.default, v))
    gathered = g.collective(c10d.all_gather_into_tensor.default, g(aten._to_copy.default, s, **bf16), 2, "dp",
                            module="layers.0.attention.wq")
    y = g(aten.mm.default, y, gathered)
    y = g(aten.mul.Tensor, y, g(aten._to_copy.default, b, **bf16))
    y = g(aten.add.Tensor, g(aten.mm.default, y, g(aten._to_copy.default, f, **bf16)),
          g(aten.sum.default, g(aten._to_copy.default, f, dtype=torch.float16)))
    ctx = context(input_names=["w", "n", "v", "s", None, "f", None])
    gm = fold_param_casts_pass(g.finish(y), ctx=ctx)
    assert ctx.input_casts == {0: "bfloat16", 1: "bfloat16"}
    assert [p.meta["val"].dtype for p in gm.graph.nodes if p.op == "placeholder"] == [
        torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16]
    assert listing(gm) == expected("""
        mm = mm(x, w)
        mul = mul.Tensor(mm, n)
        mm_1 = mm(mul, w)
        _to_copy = _to_copy(v, dtype=torch.bfloat16)
        mm_2 = mm(mm_1, _to_copy)
        sum = sum(v)
        add = add.Tensor(mm_2, sum)
        _to_copy_1 = _to_copy(s, dtype=torch.bfloat16)
        all_gather_into_tensor = all_gather_into_tensor(_to_copy_1, 2, 'dp')
        wait_tensor = wait_tensor(all_gather_into_tensor)
        mm_3 = mm(add, wait_tensor)
        _to_copy_2 = _to_copy(b, dtype=torch.bfloat16)
        mul_1 = mul.Tensor(mm_3, _to_copy_2)
        _to_copy_3 = _to_copy(f, dtype=torch.bfloat16)
        mm_4 = mm(mul_1, _to_copy_3)
        _to_copy_4 = _to_copy(f, dtype=torch.float16)
        sum_1 = sum(_to_copy_4)
        add_1 = add.Tensor(mm_4, sum_1)
    """)
    before = listing(gm)
    backward = fold_param_casts_pass(gm, ctx=context("backward", output_names=["w"]))
    assert listing(backward) == before  # a backward graph is left as it is


def test_fold_param_casts_returns_the_copies_gradients_where_the_upcast_is_all():
    """Backward: w's gradient, the upcast of its copy's, is returned as the copy's; n's upcast
    is also read by another node and v's forward took it as it is: both stay fp32."""
    from titan.builder.passes.param_casts import fold_param_casts_pass

    g = HandGraph()
    gw, gn, gv = (g.input("gw", (8, 8), torch.bfloat16), g.input("gn", (8,), torch.bfloat16),
                  g.input("gv", (8, 8), torch.bfloat16))
    up_w = g(aten._to_copy.default, gw, dtype=torch.float32)
    up_n = g(aten._to_copy.default, gn, dtype=torch.float32)
    up_v = g(aten._to_copy.default, gv, dtype=torch.float32)
    gm = g.finish(up_w, up_n, up_v, g(aten.sum.default, up_n))
    ctx = context("backward", output_names=["w", "n", "v", None])
    ctx.input_casts.update({0: "bfloat16", 1: "bfloat16"})
    gm = fold_param_casts_pass(gm, ctx=ctx)
    assert output_names(gm) == ["gw", "_to_copy", "_to_copy_1", "sum"]
    assert listing(gm) == expected("""
        _to_copy = _to_copy(gn, dtype=torch.float32)
        _to_copy_1 = _to_copy(gv, dtype=torch.float32)
        sum = sum(_to_copy)
    """)

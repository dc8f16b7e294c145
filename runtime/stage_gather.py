"""A pipeline stage's parameter gathers run once per step, not once per micro-batch (issue 28).

A stage program's graphs gather its parameters themselves (SimpleFSDP, builder/trace/
parallelize.py): the forward casts each dp-shard shard, all-gathers it (bucketed: one flat
all-gather per block) and copies each parameter out of the gathered bucket; under activation
checkpointing the backward does it again. A pipeline runs a stage's forward and backward once per
micro-batch, so as stored every micro-batch gathers again what the step's parameters already
gave: they change only at the optimizer step, after the last micro-batch.

`gather_once` cuts that out at load, a pure function on fx graphs (no format change, as
backward_split.py and loss_only.py derive theirs):

- gather:   (parameters...) -> (values...): every node of the forward computed from the
  parameters alone (the casts, the all-gathers and their waits, the copies out of a bucket, the
  views and transposes), and every such node of the backward (its recomputation's gathers, from
  the parameters the forward saved), the backward's merged with the forward's where they compute
  the same thing from the same values (then the backward gathers nothing);
- forward:  (values..., parameters..., buffers..., data...) -> what the stored forward returns;
- backward: (values..., saved..., grad_output) -> what the stored backward returns.

`values` are what the compute parts read of the gathered part. A stage runs `gather` before its
first micro-batch and keeps the values until its last backward of the step. Every node keeps its
inputs, and what moved computes on the same values as before (an all-gather is a copy, a cast or
a copy-out is deterministic), so the stage computes bitwise what the stored graphs compute per
micro-batch; the reduce-scatters of the gradients stay in each micro-batch's backward.

Memory: the values stay resident for the step (`resident_bytes`). Without activation
checkpointing the forward saved them for its backward anyway, once per micro-batch in flight;
now once. With it, they are resident where each micro-batch gathered and freed them before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from titan.runtime.contract.memory_estimate import val_bytes

_c10d = torch.ops._c10d_functional
COLLECTIVES = {_c10d.all_gather_into_tensor.default: "all-gather", _c10d.reduce_scatter_tensor.default: "reduce-scatter",
               _c10d.all_reduce.default: "all-reduce"}


@dataclass(frozen=True)
class StageGather:
    gather: fx.GraphModule
    """(parameters...) -> (values...)."""
    forward: fx.GraphModule
    """(values..., the stored forward's inputs...) -> the stored forward's outputs."""
    backward: fx.GraphModule
    """(values..., the stored backward's inputs...) -> the stored backward's outputs."""
    n_values: int

    @property
    def resident_bytes(self) -> int:
        """Bytes the values hold while resident, each storage once (a view of another value, such as a
        transposed weight, or of a parameter holds nothing of its own)."""
        return _distinct_bytes(next(n for n in self.gather.graph.nodes if n.op == "output").args[0])

    @property
    def saved_value_bytes(self) -> int:
        """Bytes of the forward's saved values (for its backward) that are gathered values, each
        saved value counted as a stage program's record counts its saved activations: these are
        held once for the step, not once per micro-batch in flight."""
        n_saved = sum(n.op == "placeholder" for n in self.backward.graph.nodes) - self.n_values - 1
        outputs = next(n for n in self.forward.graph.nodes if n.op == "output").args[0]
        values = set([n for n in self.forward.graph.nodes if n.op == "placeholder"][:self.n_values])
        return sum(_node_bytes(n) for n in outputs[len(outputs) - n_saved:] if n in values)


def _hoistable(node: fx.Node) -> bool:
    """A node whose result is a function of its inputs alone: an op that writes nothing and draws
    no random numbers."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _derived(graph: fx.Graph, roots: set[fx.Node]) -> list[fx.Node]:
    """The nodes computed from `roots` alone (each with at least one input, all in `roots` or
    derived), in graph order."""
    inside = set(roots)
    out = []
    for n in graph.nodes:
        if n in inside or not _hoistable(n) or not n.all_input_nodes:
            continue
        if all(i in inside for i in n.all_input_nodes):
            inside.add(n)
            out.append(n)
    return out


def _read_by_the_rest(moved: list[fx.Node]) -> list[fx.Node]:
    """The moved nodes that a node left in place (or the graph's output) reads."""
    moved_set = set(moved)
    return [n for n in moved if any(u not in moved_set for u in n.users)]


def _key(node: fx.Node, env: dict[fx.Node, fx.Node]):
    """What a copied node computes: its op and its (mapped) arguments, hashable."""
    def frozen(a):
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return tuple(frozen(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, frozen(v)) for k, v in a.items()))
        return (type(a).__name__, a) if isinstance(a, (bool, int, float)) else a
    return node.target, frozen(node.args), frozen(node.kwargs)


def _cut(graph: fx.GraphModule, moved: list[fx.Node], values: dict[fx.Node, int], n_values: int) -> fx.GraphModule:
    """`graph` without the `moved` nodes, reading `values` (node -> its index among the values)
    from n_values new inputs before its own."""
    moved_set = set(moved)
    out = fx.Graph()
    names = {n.name for n in graph.graph.nodes}
    inputs = []
    for i in range(n_values):
        name = f"gathered_{i}"
        while name in names:
            name = "_" + name
        inputs.append(out.placeholder(name))
    env: dict[fx.Node, fx.Node] = {}
    for node, i in values.items():
        env[node] = inputs[i]
        # An input is in no fusion region: the region it was computed in, if any, is the gather's
        # (run op by op), and the regions that read it take it across their boundary.
        inputs[i].meta = {k: v for k, v in node.meta.items() if k != "titan_region"}
    for n in graph.graph.nodes:
        if n not in moved_set:
            env[n] = out.node_copy(n, env.__getitem__)
    return fx.GraphModule(graph, out)


def gather_once(forward: fx.GraphModule, backward: fx.GraphModule, *, n_params: int) -> StageGather:
    """The stage's graphs with what its parameters alone determine moved into one gather part
    (module docstring). The forward's first `n_params` inputs are the parameters; the backward's
    inputs are what the forward returns after its first output (the saved values, in order), then
    the output's gradient. The stored graphs are left as they are."""
    fw_nodes = list(forward.graph.nodes)
    params = [n for n in fw_nodes if n.op == "placeholder"][:n_params]
    fw_moved = _derived(forward.graph, set(params))
    fw_const = set(params) | set(fw_moved)
    fw_out = next(n for n in fw_nodes if n.op == "output").args[0]
    bw_inputs = [n for n in backward.graph.nodes if n.op == "placeholder"]
    saved = list(fw_out[len(fw_out) - len(bw_inputs) + 1:])
    assert len(saved) == len(bw_inputs) - 1, (len(saved), len(bw_inputs))
    # A backward input is a step constant where the forward saved a parameter or a moved value.
    bw_roots = {b: f for b, f in zip(bw_inputs, saved) if isinstance(f, fx.Node) and f in fw_const}
    bw_moved = _derived(backward.graph, set(bw_roots))

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: graph.placeholder(p.name) for p in params}
    for p, new in env.items():
        new.meta = dict(p.meta)
    seen: dict = {}

    def copy(n: fx.Node, into: dict[fx.Node, fx.Node]) -> None:
        key = _key(n, into)
        if key in seen:  # the backward recomputes what the forward gathered: the forward's value
            into[n] = seen[key]
            return
        new = graph.node_copy(n, into.__getitem__)
        new.meta.pop("titan_region", None)  # the gather runs op by op, once per step
        into[n] = seen[key] = new

    for n in fw_moved:
        copy(n, env)
    bw_env = {b: env[f] for b, f in bw_roots.items()}
    for n in bw_moved:
        copy(n, bw_env)

    fw_read, bw_read = _read_by_the_rest(fw_moved), _read_by_the_rest(bw_moved)
    outputs: list[fx.Node] = []
    index: dict[fx.Node, int] = {}
    for new in [env[n] for n in fw_read] + [bw_env[n] for n in bw_read]:
        if new not in index:
            index[new] = len(outputs)
            outputs.append(new)
    graph.output(tuple(outputs))
    gather = fx.GraphModule(forward, graph)
    n_values = len(outputs)
    return StageGather(
        gather=gather, n_values=n_values,
        forward=_cut(forward, fw_moved, {n: index[env[n]] for n in fw_read}, n_values),
        backward=_cut(backward, bw_moved, {n: index[bw_env[n]] for n in bw_read}, n_values))


def count_collectives(graph: fx.GraphModule) -> dict[str, int]:
    """How many collectives of each kind the graph issues (all-gather, reduce-scatter, all-reduce)."""
    out: dict[str, int] = {}
    for n in graph.graph.nodes:
        if n.op == "call_function" and n.target in COLLECTIVES:
            out[COLLECTIVES[n.target]] = out.get(COLLECTIVES[n.target], 0) + 1
    return out


def _distinct_bytes(values) -> int:
    """Bytes of `values`' storages, each once: a view's is its base's (followed through view ops)."""
    bases = set()
    total = 0
    for v in values:
        base = v
        while base.op == "call_function" and isinstance(base.target, torch._ops.OpOverload) \
                and base.target.is_view and base.all_input_nodes:
            base = base.all_input_nodes[0]
        if base in bases or base.op == "placeholder":  # a parameter's: parameter state already
            continue
        bases.add(base)
        total += _node_bytes(base)
    return total


def _node_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")  # a traced graph's; a loaded one records its shape and dtype
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else val_bytes(node.meta.get("titan_val"))

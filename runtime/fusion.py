"""Generated kernels for the fusion regions of an artifact.

A region is a run of consecutive nodes tagged "<kind>#<n>" by the builder. Each is cut out as
its own small graph, compiled by inductor for this device (torch._inductor is imported only
here, and only for artifacts with regions), and called in its place. Identical regions (every
transformer block has the same ones) compile once. Regions of kind "exact" (the default
fuse_exact pass) are compiled under the exact settings below, and only on GPUs: elsewhere
their ops simply run on eager kernels, which is what they reproduce. The other kinds come from
titan-build --fuse and change numerics in the last bits.

Compiled regions are kept in a kernel store next to the build cache, keyed by the region's
code and input layouts, the device (GPU name and compute capability), and the torch and triton
versions: the first run on a kind of GPU compiles and writes them; later runs load them. What
is stored is inductor's compiled artifact, which is code: titan-run only loads entries that it
wrote itself into the store, each checked against the sha256 recorded when it was written;
treat the store like the Python environment (see README, Safety).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from titan.runtime.kernel_store import KernelStore



# Inductor settings under which a fused element-wise kernel rounds as eager's kernels do: each
# low-precision intermediate rounded where eager stores it, no a*b+c contracted into an FMA, IEEE
# division, CUDA's libdevice, no flush of denormals. Only the settings this torch has are used;
# which ops are then bit-exact is measured (benchmarks/exact_ops.py), not assumed.
_EXACT_SETTINGS = {
    "emulate_precision_casts": True,
    "use_fast_math": False,
    "eager_numerics.division_rounding": True,
    "eager_numerics.use_pytorch_libdevice": True,
    "eager_numerics.disable_ftz": True,
}


def exact_config() -> dict[str, bool]:
    """The exact settings that this torch's inductor has."""
    import torch._inductor.config as ic

    missing = object()
    out = {}
    for key, value in _EXACT_SETTINGS.items():
        obj = ic
        for part in key.split("."):
            obj = getattr(obj, part, missing)
        if obj is not missing:
            out[key] = value
    return out


EXACT = "exact"


def _kind(tag: str) -> str:
    return tag.split("#")[0]


def compiled_here(kind: str, device: torch.device) -> bool:
    """Exact regions are compiled on GPUs only (elsewhere eager's kernels are what they
    reproduce); --fuse regions on every device (C++ kernels on the CPU)."""
    return kind != EXACT or device.type == "cuda"


def has_regions(gm: fx.GraphModule, device: torch.device) -> bool:
    return any((tag := n.meta.get("titan_region")) and compiled_here(_kind(tag), device) for n in gm.graph.nodes)


def compile_program_regions(forward: fx.GraphModule, backward: fx.GraphModule,
                            device: torch.device) -> FusionStats | None:
    """Compile the regions of both graphs in place (identical regions once); None when there
    are none to compile here (then nothing of inductor is imported)."""
    if not (has_regions(forward, device) or has_regions(backward, device)):
        return None
    stats, memo, store = FusionStats(), {}, KernelStore()
    for gm in (forward, backward):
        compile_regions(gm, device=device, store=store, stats=stats, memo=memo)
    return stats


@dataclass
class FusionStats:
    regions: int = 0
    compiled: int = 0
    loaded: int = 0
    reused: int = 0
    unstored: int = 0
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        return (f"fusion: {self.regions} regions ({kinds}): {self.compiled} compiled, {self.loaded} loaded from the "
                f"kernel store, {self.reused} shared, in {self.seconds:.1f} s"
                + (f" ({self.unstored} could not be stored)" if self.unstored else ""))


def _device_tag(device: torch.device) -> str:
    """Generated CUDA code names its device index, so the index is part of the key."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor} {device}"
    return device.type


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    try:
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        out["triton"] = "none"
    return out


def _runs(gm: fx.GraphModule) -> list[list[fx.Node]]:
    runs: list[list[fx.Node]] = []
    previous = None
    for n in gm.graph.nodes:
        tag = n.meta.get("titan_region")
        if tag is not None and tag == previous:
            runs[-1].append(n)
        elif tag is not None:
            runs.append([n])
        previous = tag
    return runs


def _boundary(run: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The run's outside inputs and its outputs (members used outside), in graph order."""
    members = set(run)
    inputs: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    return inputs, [n for n in run if any(u not in members for u in n.users)]


def _signature(run: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> str:
    """What the run computes, by position: equal for identical regions (every block's)."""
    names = {a: f"in{i}" for i, a in enumerate(inputs)} | {n: f"n{i}" for i, n in enumerate(run)}
    ops = [(str(n.target), fx.node.map_arg(n.args, names.__getitem__), fx.node.map_arg(n.kwargs, names.__getitem__))
           for n in run]
    return repr((ops, [names[o] for o in outputs], [_input_layout(a) for a in inputs]))


def _extract(run: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """The run as a graph with canonical names."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = graph.placeholder(f"in{i}")
    for i, n in enumerate(run):
        env[n] = graph.create_node("call_function", n.target, fx.node.map_arg(n.args, env.__getitem__),
                                   fx.node.map_arg(n.kwargs, env.__getitem__), name=f"n{i}")
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _input_layout(node: fx.Node) -> dict:
    val = node.meta.get("titan_val")
    assert isinstance(val, dict) and "shape" in val, f"region input {node} is not a tensor"
    return val


def _example(val: dict, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(val["shape"], val["stride"], dtype=getattr(torch, val["dtype"]), device=device)


def _region_call(compiled, name: str):
    def call(*args):
        return compiled(*args)
    call.__name__ = call.__qualname__ = name
    return call


def compile_regions(gm: fx.GraphModule, *, device: torch.device, store: KernelStore,
                    stats: FusionStats, memo: dict) -> fx.GraphModule:
    """Replace every region of `gm` with a call of its compiled kernels."""
    from torch._inductor import standalone_compile

    import torch._inductor.config as inductor_config

    t0 = time.perf_counter()
    context = {"device": _device_tag(device), **_versions()}
    exact = exact_config()
    for run in _runs(gm):
        kind = _kind(run[0].meta["titan_region"])
        if not compiled_here(kind, device):
            continue
        settings = exact if kind == EXACT else {}
        inputs, outputs = _boundary(run)
        # Identical regions are recognized by signature, before any graph is built for them.
        signature = (kind, _signature(run, inputs, outputs))
        compiled = memo.get(signature)
        if compiled is not None:
            stats.reused += 1
        else:
            sub = _extract(run, inputs, outputs)
            layouts = [_input_layout(a) for a in inputs]
            key = hashlib.sha256(json.dumps([sub.code, layouts, context, settings],
                                            sort_keys=True).encode()).hexdigest()[:32]
            compiled = store.load(key)
            if compiled is not None:
                stats.loaded += 1
            else:
                examples = [_example(v, device) for v in layouts]
                with inductor_config.patch(settings):
                    compiled = standalone_compile(sub, examples, dynamic_shapes="from_example_inputs")
                stats.compiled += 1
                try:
                    store.save(key, compiled)
                except RuntimeError:
                    stats.unstored += 1  # inductor produced nothing it can serialize; compiled each run
            memo[signature] = compiled
        stats.regions += 1
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1
        graph = gm.graph
        with graph.inserting_before(run[0]):
            call = graph.call_function(_region_call(compiled, f"{kind}_region"), tuple(inputs))
            results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
        for old, new in zip(outputs, results):
            new.meta["titan_val"] = old.meta.get("titan_val")
            old.replace_all_uses_with(new)
        for n in reversed(run):
            graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    stats.seconds += time.perf_counter() - t0
    return gm

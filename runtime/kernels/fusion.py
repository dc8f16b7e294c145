"""Generated kernels for the fusion regions of an artifact.

A region is a run of consecutive nodes tagged "<kind>#<n>" by the builder. Each is cut out as
its own small graph, compiled by inductor for this device (torch._inductor is imported only
here, and only for artifacts with regions), and called in its place. Identical regions (every
transformer block has the same ones) compile once. Regions of kind "exact" (the default
fuse_exact pass) are compiled under the exact settings below, and only on GPUs: elsewhere
their ops simply run on eager kernels, which is what they reproduce. The other kinds come from
titan-build --fuse and change numerics in the last bits.

Compiled regions are code, so they come only from where the user trusts code to come from
(docs/trust.md): the artifact's kernels when its manifest is signed by a key the user trusts, or
the user opted in (runtime/kernels/artifact_trust.py decides; each file is checked against the
manifest's sha256; titan-build --kernels puts them there), else the kernel store through a
record authenticated with the user's key (runtime/store/kernel_store.py), else compiled here and
stored. Nothing is unpickled: what is loaded is a kernel plan (data, checked), and a region
that has none is compiled here at every run (inductor's own cache, private to the user,
runtime/common/compiler_caches.py, makes that fast after the first time). A kernel's key is what shapes its
code: the region's graph and input layouts, the compile settings, the GPU architecture (name
and compute capability, never the device index) and the torch and triton versions. Generated
CUDA code names the device it was compiled for, so kernels are compiled, stored and loaded on
cuda:0: titan-run starts each local rank seeing only its own GPU (as torchrun's
--virtual-local-rank does); a rank on another index compiles its regions for itself and shares
nothing. Ranks of a host compile a key under its lock: one compiles, the others load. Where
several regions are missing on a GPU, worker processes compile them first, in parallel
(runtime/kernels/compile_workers.py).

FlexAttention's fused kernels (runtime/kernels/flex_kernels.py) are compiled regions too, keyed,
sourced and stored by the same functions (load_kernel, compile_region): compile_regions loads
them for a graph's flex calls on GPUs.

On GPUs a compiled region is stored as a kernel plan where it can be (runtime/kernels/kernel_plan.py):
its cubins and launches as data, run through torch's static CUDA launcher. A run whose regions
all come as plans never imports inductor, which is most of a warm start's time otherwise. Plans
exist on GPUs only: on the CPU, --fuse regions are compiled at every run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

import titan.runtime.common.compiler_caches as compiler_caches
from titan.runtime.store.kernel_store import KernelStore

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
    # One config per element-wise kernel: choosing among several is a timing on the device,
    # which a build without one cannot make (builder/export/offline_kernels.py). Every config
    # of an element-wise kernel computes the same bits; only the block size differs.
    "triton.autotune_pointwise": False,
}
# FlexAttention's kernels (runtime/kernels/flex_kernels.py): its backward has a reduction before
# the template, and a reduction gets several configs to choose among by timing unless inductor
# is deterministic (one config, chosen by rule: what a build without a GPU can make too).
_FLEX_SETTINGS = {
    "deterministic": True,
    "triton.autotune_pointwise": False,
}


def settings_asked(kind: str) -> dict[str, bool]:
    """The inductor settings a region of `kind` asks for (a kernel key's factor: the settings
    asked, not the subset this inductor has, which would need inductor imported to read)."""
    return _EXACT_SETTINGS if kind == EXACT else _FLEX_SETTINGS if kind.startswith("flex") else {}


def available_settings(kind: str) -> dict[str, bool]:
    """The settings asked for `kind` that this torch's inductor has."""
    import torch._inductor.config as ic

    missing = object()
    out = {}
    for key, value in settings_asked(kind).items():
        obj = ic
        for part in key.split("."):
            obj = getattr(obj, part, missing)
        if obj is not missing:
            out[key] = value
    return out


def exact_config() -> dict[str, bool]:
    """The exact settings that this torch's inductor has."""
    return available_settings(EXACT)


EXACT = "exact"


def region_kind(tag: str) -> str:
    """The kind of a region tag "<kind>#<n>"."""
    return tag.split("#")[0]


def compiled_here(kind: str, device: torch.device) -> bool:
    """Exact regions are compiled on GPUs only (elsewhere eager's kernels are what they
    reproduce); --fuse regions on every device (C++ kernels on the CPU)."""
    return kind != EXACT or device.type == "cuda"


FLEX_OPS = frozenset({"titan.flex_attention.default", "titan.flex_attention_backward.default"})
"""The flex op, whose CUDA kernels are compiled regions too (runtime/kernels/flex_kernels.py)."""


def has_regions(gm: fx.GraphModule, device: torch.device) -> bool:
    return any(((tag := n.meta.get("titan_region")) and compiled_here(region_kind(tag), device))
               or (device.type == "cuda" and n.op == "call_function" and str(n.target) in FLEX_OPS)
               for n in gm.graph.nodes)


class KernelSources:
    """Where compiled regions come from, in order: the artifact (`artifact_kernel`: given only
    when its kernels are trusted, runtime/kernels/artifact_trust.py), the kernel store
    (authenticated records), compiling here. `recorded` collects every kernel key used and its
    sha256 (titan-build --kernels writes them into the build's cache entry)."""

    def __init__(self, *, device: torch.device, artifact_kernel: Callable[[str], bytes | None] | None = None,
                 store: KernelStore | None = None):
        self.artifact_kernel = artifact_kernel or (lambda key: None)
        # Generated CUDA code is bound to the device index it was compiled for: only cuda:0's
        # kernels are shared (see the module docstring).
        self.shareable = device.type != "cuda" or device.index in (None, 0)
        self._store = store
        self.recorded: dict[str, str] = {}
        self.compiled_by_workers: frozenset[str] = frozenset()
        """Keys this run's compile workers put into the store (runtime/kernels/compile_workers.py)."""
        # What was read, so that deciding what the workers compile costs no second read of a kernel.
        self._from_artifact: dict[str, bytes | None] = {}
        self._in_store: dict[str, tuple[bytes, str]] = {}

    def from_artifact(self, key: str) -> bytes | None:
        if key not in self._from_artifact:
            self._from_artifact[key] = self.artifact_kernel(key)
        return self._from_artifact[key]

    def from_store(self, key: str) -> tuple[bytes, str] | None:
        """The store's entry (bytes, sha256); a miss is not remembered (another process may store it)."""
        found = self._in_store.get(key) or self.store.load(key)
        if found is not None:
            self._in_store[key] = found
        return found

    @property
    def store(self) -> KernelStore:
        if self._store is None:
            self._store = KernelStore()
        return self._store


def compile_program_regions(forward: fx.GraphModule, backward: fx.GraphModule, device: torch.device, *,
                            artifact_kernel: Callable[[str], bytes | None] | None = None,
                            stats: FusionStats | None = None,
                            sources: KernelSources | None = None) -> FusionStats | None:
    """Compile the regions of both graphs in place (identical regions once); None when there
    are none to compile here (then nothing of inductor is imported). `artifact_kernel` serves
    the artifact's kernels, tried first: pass it only when they are trusted. `stats`: counted
    into (a pipeline rank's stages, one line); a new one otherwise. `sources`: what an earlier
    look at the same graphs read (runtime/kernels/background.py), else made here."""
    if not (has_regions(forward, device) or has_regions(backward, device)):
        return None
    sources = sources or KernelSources(device=device, artifact_kernel=artifact_kernel)
    stats, memo = stats or FusionStats(), {}
    t0 = time.perf_counter()
    from titan.runtime.kernels.compile_workers import compile_in_parallel
    parallel = compile_in_parallel((forward, backward), device, sources)
    if parallel is not None:
        sources.compiled_by_workers = parallel.stored
        stats.workers = max(stats.workers, parallel.workers)
        stats.worker_failures += parallel.failures
    stats.seconds += time.perf_counter() - t0
    for gm in (forward, backward):
        compile_regions(gm, device=device, sources=sources, stats=stats, memo=memo)
    return stats


@dataclass
class FusionStats:
    regions: int = 0
    compiled: int = 0
    loaded: int = 0
    from_artifact: int = 0
    reused: int = 0
    unstored: int = 0
    planned: int = 0
    """Regions compiled or loaded as kernel plans (launched without inductor)."""
    ignored: int = 0
    """Kernels the artifact carries that are not plans for this device (compiled here instead)."""
    workers: int = 0
    """Processes that compiled regions in parallel (runtime/kernels/compile_workers.py)."""
    worker_failures: tuple[str, ...] = ()
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        return (f"fusion: {self.regions} regions ({kinds}): {self.compiled} compiled, {self.loaded} loaded from the "
                f"kernel store, {self.from_artifact} from the artifact, {self.reused} shared, in {self.seconds:.1f} s"
                + (f" ({self.unstored} not stored)" if self.unstored else "")
                + (f"; {self.planned} as kernel plans" if self.planned else "")
                + (f"; {self.ignored} of the artifact's kernels are not plans for this device" if self.ignored else "")
                + (f"; compiled by {self.workers} processes in parallel" if self.workers else "")
                + (f" ({len(self.worker_failures)} failed, their regions compiled here: {self.worker_failures[0]})"
                   if self.worker_failures else "")
                + ("" if "torch._inductor" in sys.modules else "; inductor not loaded"))


def device_tag(device: torch.device) -> str:
    """The kind of device code is generated for: GPU name and compute capability (never the
    index: kernels are shared by every GPU of a kind), or the CPU's vector instruction set."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    if device.type == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        return f"cpu {pick_vec_isa()}"
    return device.type


def kernel_key(sub: fx.GraphModule, layouts: list[dict], kind: str, context: dict) -> str:
    # The settings asked for, not the subset this inductor has: reading that would import
    # inductor, which a run whose kernels are all plans never does (the torch version in the
    # key fixes the subset).
    return hashlib.sha256(json.dumps([sub.code, layouts, context, settings_asked(kind)],
                                     sort_keys=True).encode()).hexdigest()[:32]


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


def _region_call(compiled, name: str, layouts: list[dict]):
    """The graph's call of a region's kernels. A kernel plan reads its inputs in the layouts it
    was compiled for (`layouts`, the graph's record) without looking: an input that arrives in
    another layout (a producer whose real strides differ from the recorded ones) would be read
    wrong, silently. So the call compares them, once: each call site has its own call, and what
    reaches a site (the same producers in the same graph) has the same layout at every step."""
    expected = [(tuple(v["shape"]), tuple(v["stride"]), getattr(torch, v["dtype"])) for v in layouts]
    checked = False

    def call(*args):
        nonlocal checked
        if checked:  # the training step's hot path: one flag
            return compiled(*args)
        for i, (t, (shape, stride, dtype)) in enumerate(zip(args, expected)):
            if t.shape != shape or t.dtype != dtype or any(
                    n > 1 and a != b for n, a, b in zip(shape, t.stride(), stride)):
                raise RuntimeError(f"{name}: input {i} arrives as {tuple(t.shape)} {t.dtype} strides {t.stride()}, "
                                   f"but its kernels were compiled for {shape} {dtype} strides {stride}: the "
                                   "artifact's recorded layout is not what runs; please report it")
        checked = True
        return compiled(*args)
    call.__name__ = call.__qualname__ = name
    return call


def compile_settings(kind: str) -> dict[str, bool]:
    """The inductor settings a region of `kind` is compiled under (here and by a build for a
    named GPU, builder/export/offline_kernels.py: the same settings make the same kernels)."""
    import torch._inductor.config as inductor_config

    settings = available_settings(kind)
    # Plans are recorded from the static launcher's calls: use it wherever inductor can.
    return settings | {name: True for name in ("use_static_cuda_launcher", "use_static_triton_launcher")
                       if hasattr(inductor_config, name)}


def compile_region(sub: fx.GraphModule | Callable[[], fx.GraphModule], layouts: list[dict], kind: str,
                   device: torch.device, *, inputs: Callable[[], list[torch.Tensor]] | None = None):
    """(the compiled region, its kernel plan's bytes or None: runtime/kernels/kernel_plan.py).
    `sub` may be a function that makes the graph (made only here, where inductor is imported);
    `inputs` makes the inputs its plan is recorded on, where random ones of `layouts` will not do."""
    compiler_caches.ensure()  # inductor's caches are the user's private ones before it is imported
    from torch._inductor import standalone_compile

    import torch._inductor.config as inductor_config

    from titan.runtime.kernels.kernel_plan import BadPlan, decode_plan, encode_plan
    from titan.runtime.kernels.plan_recorder import record_plan, recording

    settings = compile_settings(kind)
    sub = sub if isinstance(sub, fx.GraphModule) else sub()
    examples = [_example(v, device) for v in layouts]
    with recording() as recorder, inductor_config.patch(settings):
        compiled = standalone_compile(sub, examples, dynamic_shapes="from_example_inputs")
        plan = (record_plan(compiled, layouts, device, recorder, inputs=inputs)
                if recorder is not None and device.type == "cuda" else None)
    data = encode_plan(plan) if plan is not None else None
    if data is not None:
        try:
            decode_plan(data)  # a plan that a run would refuse is not kept: the region is compiled at each run
        except BadPlan:
            data = None
    return compiled, data


def _planned(data: bytes, device: torch.device, where: str):
    """The region run from the kernel plan in `data` (verified bytes), or None where `data` is
    no plan this device can run (then the region is compiled here). Nothing else is loaded:
    inductor's own artifacts unpickle."""
    from titan.runtime.kernels.kernel_plan import PlannedRegion, decode_plan, is_plan

    if device.type != "cuda" or not is_plan(data):
        return None
    try:
        return PlannedRegion(decode_plan(data), device)
    except ValueError as e:
        raise ValueError(f"a kernel plan from {where} is malformed ({e}); remove the kernel store's entry "
                         "(titan-cache verify --remove) or rebuild the artifact's kernels with titan-build --kernels") from None


def load_kernel(key: str, compile_here: Callable[[], tuple], device: torch.device, sources: KernelSources,
                stats: FusionStats):
    """The region's compiled kernels: from the artifact, the store, or compiled by `compile_here`
    (-> (compiled, plan bytes or None); once per host: under the key's lock, the first rank
    compiles and the others then load)."""
    data = sources.from_artifact(key)
    if data is not None:
        region = _planned(data, device, "the artifact")
        if region is not None:
            stats.from_artifact += 1
            stats.planned += 1
            sources.recorded[key] = hashlib.sha256(data).hexdigest()
            return region
        stats.ignored += 1
    if not sources.shareable:
        stats.compiled += 1
        stats.unstored += 1
        return compile_here()[0]
    store = sources.store
    found = sources.from_store(key)
    region = None if found is None else _planned(found[0], device, "the kernel store")
    if region is None:
        with store.lock(key) as lock:
            lock.acquire(blocking=True)
            found = store.load(key)  # compiled by another rank while this one waited
            region = None if found is None else _planned(found[0], device, "the kernel store")
            if region is None:
                compiled, plan = compile_here()
                stats.compiled += 1
                if plan is None:
                    stats.unstored += 1  # compiled again by each run (no plan: nothing to store)
                else:
                    stats.planned += 1
                    sources.recorded[key] = store.save(key, plan, device=device_tag(device))
                return compiled
    if key in sources.compiled_by_workers:
        stats.compiled += 1  # by this run, in a worker process
    else:
        stats.loaded += 1
    stats.planned += 1
    sources.recorded[key] = found[1]
    return region


def kernel_context(device: str) -> dict[str, str]:
    """What besides the region shapes its kernels: the device kind (device_tag) and the
    torch and triton versions."""
    return {"device": device, **_versions()}


def region_kernels(gm: fx.GraphModule, *, device: str) -> dict[str, tuple[str, fx.GraphModule, list[dict]]]:
    """Each distinct exact or --fuse region of `gm` as kernel key -> (kind, graph, input
    layouts), keyed as compile_regions keys it for a device whose device_tag is `device`."""
    context = kernel_context(device)
    out, seen = {}, set()
    for run in _runs(gm):
        kind = region_kind(run[0].meta["titan_region"])
        inputs, outputs = _boundary(run)
        signature = (kind, _signature(run, inputs, outputs))
        if signature in seen:  # identical regions (every block's) have one key: built once
            continue
        seen.add(signature)
        sub = _extract(run, inputs, outputs)
        layouts = [_input_layout(a) for a in inputs]
        out[kernel_key(sub, layouts, kind, context)] = (kind, sub, layouts)
    return out


def compile_regions(gm: fx.GraphModule, *, device: torch.device, sources: KernelSources,
                    stats: FusionStats, memo: dict) -> fx.GraphModule:
    """Replace every region of `gm` with a call of its compiled kernels."""
    compiler_caches.ensure()  # before anything of inductor is imported (device_tag imports it on the CPU)
    t0 = time.perf_counter()
    context = kernel_context(device_tag(device))
    for run in _runs(gm):
        kind = region_kind(run[0].meta["titan_region"])
        if not compiled_here(kind, device):
            continue
        inputs, outputs = _boundary(run)
        # Identical regions are recognized by signature, before any graph is built for them.
        signature = (kind, _signature(run, inputs, outputs))
        layouts = [_input_layout(a) for a in inputs]
        compiled = memo.get(signature)
        if compiled is not None:
            stats.reused += 1
        else:
            sub = _extract(run, inputs, outputs)
            compiled = load_kernel(kernel_key(sub, layouts, kind, context),
                                   lambda: compile_region(sub, layouts, kind, device), device, sources, stats)
            memo[signature] = compiled
        stats.regions += 1
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1
        graph = gm.graph
        with graph.inserting_before(run[0]):
            call = graph.call_function(_region_call(compiled, f"{kind}_region", layouts), tuple(inputs))
            results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
        for old, new in zip(outputs, results):
            new.meta["titan_val"] = old.meta.get("titan_val")
            old.replace_all_uses_with(new)
        for n in reversed(run):
            graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    if device.type == "cuda":  # the flex op's fused kernels, loaded before anything runs
        from titan.runtime.kernels.flex_kernels import prepare_flex
        prepare_flex(gm, device=device, sources=sources, stats=stats)
    stats.seconds += time.perf_counter() - t0
    return gm

"""A program's metadata (programs/<sha256>.json; spec: artifacts/README.md): what its forward
graph takes, what its backward returns, and its parameter table. titan-build traces it for one
rank (a rank and its coordinates; each slice cut at the rank's coordinate) and stores it for a
program (no rank; each slice names the mesh dimension whose coordinate cuts it); a loading
rank binds it to its own coordinates (bind_program) and checks it against the graphs it loaded
(check_graphs). No torch import at module level."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from titan.runtime.contract.bindings import bound_params
from titan.runtime.contract.checks import ArtifactError, check_int, check_shape, check_str, fail
from titan.runtime.contract.dtypes import PARAM_DTYPES, is_dtype_name
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.shards import shard_box

if TYPE_CHECKING:
    import torch.fx as fx

INIT_KINDS = ("normal", "trunc_normal", "ones", "zeros")
INPUT_KINDS = ("param", "buffer", "tokens", "activations", "labels")
"""A pipeline stage's program takes `activations` (what the stage before it sent) where the first
stage, and every program of a build without a pipeline, takes `tokens`."""
BUFFER_DTYPES = ("float32", "int64")
BUFFER_METRICS = ("tokens_per_expert", "dropped_tokens")
"""What a buffer may feed in titan-run's per-step metrics (runtime/buffer_state.py)."""


CAST_DTYPES = ("bfloat16", "float16")
"""The dtypes a parameter input may be taken in as its copy (builder/passes/param_casts.py)."""


@dataclass(kw_only=True, frozen=True)
class GraphInput:
    """One input of the forward graph, in order: a parameter or a buffer (by name), the tokens or
    the labels."""
    kind: str
    fqn: str | None = None
    cast: str | None = None
    """A parameter the forward takes as its copy in this dtype (one of CAST_DTYPES), which the
    runtime keeps and the optimizer step writes (runtime/param_copies.py); None: as it is."""

    def to_json(self) -> dict:
        d = {"kind": self.kind} if self.fqn is None else {"kind": self.kind, "fqn": self.fqn}
        return d if self.cast is None else dict(d, cast=self.cast)

    @staticmethod
    def from_json(d: dict, where: str) -> GraphInput:
        cast = d.get("cast")
        if cast is not None and (d["kind"] != "param" or cast not in CAST_DTYPES):
            fail(where, f"forward input {str(d.get('fqn'))[:80]!r}: only a parameter is taken as a copy, in "
                        f"{' or '.join(CAST_DTYPES)}")
        return GraphInput(kind=d["kind"], fqn=d.get("fqn"), cast=cast)


@dataclass(kw_only=True, frozen=True)
class ParamShard:
    """Where a rank's shard of one parameter sits in the global tensor (builder/trace/parallelize.py
    cuts it)."""
    fqn: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    """The shard's shape, padded to full chunks where a cut does not divide (runtime/contract/shards.py)."""
    placements: dict[str, str]
    """Mesh dimension -> DTensor placement ("S(0)", "R"), for the tools."""
    slices: tuple[tuple, ...]
    """(dim, parts, index) cuts, applied in order; in a stored program the index is the name of
    the mesh dimension whose coordinate it is (bindings.py binds it)."""

    def spec(self, init: dict) -> ParamSpec:
        """This shard's entry in the artifact's parameter table, drawn by `init` (an init spec)."""
        return ParamSpec(**{f.name: getattr(self, f.name) for f in fields(ParamShard)}, init=init)


@dataclass(kw_only=True, frozen=True)
class ParamSpec(ParamShard):
    """One parameter of the program: this rank's shard of it and its init."""
    init: dict
    """{"kind": one of INIT_KINDS, "std", "a", "b"}: how a seeded run draws the full tensor."""
    dtype: str = "float32"

    def to_json(self) -> dict:
        return {"fqn": self.fqn, "global_shape": list(self.global_shape), "local_shape": list(self.local_shape),
                "placements": self.placements, "slices": [list(s) for s in self.slices], "init": self.init,
                "dtype": self.dtype}

    @staticmethod
    def from_json(p, where: str) -> ParamSpec:
        """A parameter entry whose slices are bound (integer indices), checked."""
        if not isinstance(p, dict) or not isinstance(p.get("fqn"), str) or not p["fqn"]:
            fail(where, "parameter entry without a name")
        where = f"{where} parameter {p['fqn'][:80]}"
        global_shape = check_shape(p.get("global_shape"), where)
        slices = p.get("slices")
        if not isinstance(slices, list) or len(slices) > 4:
            fail(where, "bad slices")
        for cut in slices:
            if not isinstance(cut, list) or len(cut) != 3:
                fail(where, f"bad slice {cut!r}")
            check_int(cut[0], where, 0, len(global_shape) - 1)
            parts = check_int(cut[1], where, 1, 1 << 16)
            check_int(cut[2], where, 0, parts - 1)
        # A cut that does not divide its dim leaves padded chunks (runtime/contract/shards.py), as FSDP2 does.
        local = shard_box(slices, list(global_shape)).local_shape
        if local != check_shape(p.get("local_shape"), where):
            fail(where, f"slices of {list(global_shape)} give {list(local)}, not local_shape {p.get('local_shape')}")
        init = _checked_init(p.get("init"), where)
        placements = p.get("placements", {})
        if not isinstance(placements, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in placements.items()):
            fail(where, "placements must map mesh dimensions to placements")
        return ParamSpec(fqn=p["fqn"], global_shape=global_shape, local_shape=local, placements=placements,
                         slices=tuple(tuple(cut) for cut in slices), init=init,
                         dtype=_checked_dtype(p.get("dtype", "float32"), where))


def _checked_dtype(name, where: str) -> str:
    if not is_dtype_name(name, PARAM_DTYPES):
        fail(where, f"dtype {str(name)[:40]!r} is not one of {', '.join(PARAM_DTYPES)}")
    return name


def _checked_init(init, where: str) -> dict:
    if not isinstance(init, dict) or init.get("kind") not in INIT_KINDS:
        fail(where, f"unknown init {init!r}")
    for key in ("std", "a", "b"):
        if key in init and (not isinstance(init[key], (int, float)) or not math.isfinite(init[key])):
            fail(where, f"init {key} is not a finite number")
    if init["kind"] in ("normal", "trunc_normal") and not 0 < init.get("std", -1) < 1e3:
        fail(where, "init std out of range")
    if init["kind"] == "trunc_normal" and not init.get("a", 1) < init.get("b", 0):
        fail(where, "trunc_normal needs a < b")
    return init


@dataclass(kw_only=True, frozen=True)
class BufferSpec:
    """One buffer of the model: state its forward updates outside the gradient (a mixture of
    experts' balancing bias and expert load). Zeros at the start, checkpointed; the same on
    every rank."""
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    """One of BUFFER_DTYPES."""
    metric: str | None = None
    """The per-step metric it feeds (one of BUFFER_METRICS), or None."""

    def to_json(self) -> dict:
        return {"fqn": self.fqn, "shape": list(self.shape), "dtype": self.dtype, "metric": self.metric}

    @staticmethod
    def from_json(b, where: str) -> BufferSpec:
        if not isinstance(b, dict) or not isinstance(b.get("fqn"), str) or not b["fqn"]:
            fail(where, "buffer entry without a name")
        where = f"{where} buffer {b['fqn'][:80]}"
        if b.get("dtype") not in BUFFER_DTYPES or b.get("metric") not in (None, *BUFFER_METRICS):
            fail(where, f"unknown dtype {str(b.get('dtype'))[:20]!r} or metric {str(b.get('metric'))[:40]!r}")
        return BufferSpec(fqn=b["fqn"], shape=check_shape(b.get("shape"), where), dtype=b["dtype"],
                          metric=b.get("metric"))


@dataclass(kw_only=True, frozen=True)
class Bucket:
    """Collectives of one block that a bucketing pass merged into one (titan-show lists them):
    an "all_gather" or "reduce_scatter" in the "forward" or "backward" graph, on the `group`
    mesh dimension, of `elements` per rank (`bytes`: the gathered / reduced size)."""
    graph: str
    kind: str
    group: str
    block: str
    params: tuple[str, ...]
    elements: int
    dtype: str
    bytes: int

    def to_json(self) -> dict:
        return {"graph": self.graph, "kind": self.kind, "group": self.group, "block": self.block,
                "params": list(self.params), "elements": self.elements, "dtype": self.dtype, "bytes": self.bytes}

    @staticmethod
    def from_json(b, where: str) -> Bucket:
        where = f"{where} bucket plan"
        if not isinstance(b, dict) or not isinstance(b.get("params"), list):
            fail(where, "a bucket must be a map with its parameters")
        return Bucket(**{k: check_str(b.get(k), where, k) for k in ("graph", "kind", "group", "block", "dtype")},
                      params=tuple(check_str(p, where, "parameter") for p in b["params"]),
                      elements=check_int(b.get("elements"), where), bytes=check_int(b.get("bytes"), where, 0, 1 << 62))


@dataclass(kw_only=True, frozen=True)
class StagePlace:
    """A pipeline stage's place (docs/pipeline.md): which of the pipeline's stages it is and the
    blocks it holds (the first stage also the embedding, the last the norm, output and loss)."""
    index: int
    stages: int
    """The pipeline's stage count."""
    layers: tuple[int, int]
    """The [start, stop) of the transformer blocks it holds."""

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    def place_json(self) -> dict:
        return {"index": self.index, "stages": self.stages, "layers": list(self.layers)}


@dataclass(kw_only=True, frozen=True)
class StageIO(StagePlace):
    """A pipeline stage program's place and the activations it receives and sends, this rank's
    local shard of them (sequence-sharded under tensor parallelism)."""
    input_shape: tuple[int, ...] | None
    """The activations it receives (None: the first stage, which reads tokens)."""
    output_shape: tuple[int, ...] | None
    """The activations it sends on (None: the last stage, which returns its loss)."""
    dtype: str
    """The activations' dtype (the build's compute dtype)."""
    reads_tokens: bool = False
    """A stage past the first that also takes the micro-batch's tokens (the document mask computes
    each token's document from them inside the step; docs/pipeline.md). Written only when set:
    a record written before reads as False."""
    gathered_bytes: int = 0
    """What the stage's parameters alone determine (their dp-shard all-gathers, casts and copies),
    held for the step when it is gathered once per step (runtime/stage_gather.py)."""
    gathered_saved_bytes: int = 0
    """Of the record's saved_bytes, the saved values that are gathered ones: held once for the step
    then, not once per micro-batch in flight."""

    def to_json(self) -> dict:
        d = {**self.place_json(), "input_shape": None if self.input_shape is None else list(self.input_shape),
             "output_shape": None if self.output_shape is None else list(self.output_shape), "dtype": self.dtype}
        d = {**d, "reads_tokens": True} if self.reads_tokens else d
        if self.gathered_bytes or self.gathered_saved_bytes:  # a stage that gathers nothing reads as before
            d.update(gathered_bytes=self.gathered_bytes, gathered_saved_bytes=self.gathered_saved_bytes)
        return d

    @staticmethod
    def from_json(d, where: str) -> StageIO:
        where = f"{where} stage"
        if not isinstance(d, dict):
            fail(where, "must be a map")
        stages = check_int(d.get("stages"), f"{where} count", 2, MAX_STAGES)
        index = check_int(d.get("index"), f"{where} index", 0, stages - 1)
        layers = d.get("layers")
        if not isinstance(layers, list) or len(layers) != 2:
            fail(where, "layers must be [start, stop]")
        start = check_int(layers[0], f"{where} layers", 0, 1 << 16)
        stop = check_int(layers[1], f"{where} layers", start + 1, 1 << 16)
        shapes = [None if d.get(k) is None else check_shape(d.get(k), f"{where} {k}")
                  for k in ("input_shape", "output_shape")]
        if (shapes[0] is None) != (index == 0) or (shapes[1] is None) != (index == stages - 1):
            fail(where, "only the first stage receives no activations and only the last sends none")
        if d.get("dtype") not in ACTIVATION_DTYPES:
            fail(where, f"activation dtype {str(d.get('dtype'))[:20]!r} is not one of {', '.join(ACTIVATION_DTYPES)}")
        reads_tokens = d.get("reads_tokens", False)
        if not isinstance(reads_tokens, bool) or (reads_tokens and index == 0):
            fail(where, "reads_tokens must be true or false, and true only past the first stage")
        gathered = [check_int(d.get(k, 0), f"{where} {k}", 0, 1 << 62)
                    for k in ("gathered_bytes", "gathered_saved_bytes")]
        return StageIO(index=index, stages=stages, layers=(start, stop), input_shape=shapes[0],
                       output_shape=shapes[1], dtype=d["dtype"], reads_tokens=reads_tokens,
                       gathered_bytes=gathered[0], gathered_saved_bytes=gathered[1])

    def expected_inputs(self) -> dict[str, int]:
        """How many data inputs of each kind its forward takes."""
        return {"tokens": int(self.first or self.reads_tokens), "activations": int(not self.first),
                "labels": int(self.last)}


MAX_STAGES = 1024
ACTIVATION_DTYPES = ("float32", "bfloat16")


@dataclass(kw_only=True, frozen=True)
class RankRecord:
    params: tuple[ParamSpec, ...]
    """The parameter inputs' table, in forward-input order."""
    forward_inputs: tuple[GraphInput, ...]
    static_input_indices: tuple[int, ...]
    """The forward inputs that keep their address across steps (the parameters and buffers)."""
    saved_activations: int
    """Values the forward returns after the loss, for the backward."""
    saved_bytes: int
    backward_outputs: tuple[str | None, ...]
    """Per forward input, the parameter whose gradient the backward returns there (None: none)."""
    bucket_plan: tuple[Bucket, ...] = ()
    """The collectives the bucketing passes merged, in graph order."""
    rank: int | None = None
    coords: dict[str, int] | None = None
    """The rank and its mesh coordinates: set in a traced or bound record, not in a stored one."""
    forward_graph: str | None = None
    backward_graph: str | None = None
    """The sha256 of the program's graphs: set once they are stored."""
    grad_reductions_owed: dict = field(default_factory=dict)
    """Always {}: every data- and tensor-parallel reduction is inside the backward graph."""
    buffers: tuple[BufferSpec, ...] = ()
    """The buffer inputs' table, in forward-input order (runtime/buffer_state.py)."""
    mutated_buffers: tuple[str, ...] = ()
    """The buffers whose new values the forward returns first (before the loss), in order: the
    runtime copies them back after the backward."""
    model_plan: dict | None = None
    """What the model decided for its ranks, the same on each (a mixture of experts' dispatch
    plan: ModelSpec.place_rank), for the tools."""
    stage: StageIO | None = None
    """A pipeline stage's program: its stage and activations (None: the whole model's)."""

    @property
    def param_fqns(self) -> list[str]:
        return [p.fqn for p in self.params]

    def to_json(self) -> dict:
        d = {} if self.rank is None else {"rank": self.rank, "coords": self.coords}
        d.update(params=[p.to_json() for p in self.params], forward_inputs=[i.to_json() for i in self.forward_inputs],
                 static_input_indices=list(self.static_input_indices), saved_activations=self.saved_activations,
                 saved_bytes=self.saved_bytes, backward_outputs=list(self.backward_outputs),
                 grad_reductions_owed=self.grad_reductions_owed, bucket_plan=[b.to_json() for b in self.bucket_plan])
        if self.forward_graph is not None:
            d.update(forward_graph=self.forward_graph, backward_graph=self.backward_graph)
        if self.buffers:
            d.update(buffers=[b.to_json() for b in self.buffers], mutated_buffers=list(self.mutated_buffers))
        if self.model_plan is not None:
            d.update(model_plan=self.model_plan)
        if self.stage is not None:
            d.update(stage=self.stage.to_json())
        return d

    @staticmethod
    def from_json(meta, where: str) -> RankRecord:
        """A rank's record (its slices bound), checked: well formed and self-consistent."""
        if not isinstance(meta, dict):
            fail(where, "rank metadata must be a map")
        inputs = meta.get("forward_inputs")
        if not isinstance(inputs, list):
            fail(where, "'forward_inputs' must be a list")
        kinds = [i.get("kind") if isinstance(i, dict) else None for i in inputs]
        stage = None if meta.get("stage") is None else StageIO.from_json(meta["stage"], where)
        data = {"tokens": 1, "activations": 0, "labels": 1} if stage is None else stage.expected_inputs()
        if any(k not in INPUT_KINDS for k in kinds) or any(kinds.count(k) != n for k, n in data.items()):
            wanted = " and ".join(f"one {k}" for k, n in data.items() if n)
            fail(where, f"forward inputs must be parameters and buffers plus {wanted} input")
        params = meta.get("params")
        if not isinstance(params, list) or len(params) != kinds.count("param"):
            fail(where, "'params' does not match the parameter inputs")
        params = tuple(ParamSpec.from_json(p, where) for p in params)
        fqns = [i.get("fqn") for i in inputs if i["kind"] == "param"]
        if fqns != [p.fqn for p in params]:
            fail(where, "parameter inputs and 'params' name different parameters")
        forward_inputs = tuple(GraphInput.from_json(i, where) for i in inputs)
        if any(i.cast is not None and p.dtype != "float32"
               for i, p in zip((i for i in forward_inputs if i.kind == "param"), params)):
            fail(where, "only a float32 parameter is taken as a lower-precision copy")
        saved = check_int(meta.get("saved_activations"), f"{where} saved_activations", 0, 1 << 20)
        outs = meta.get("backward_outputs")
        if outs != [i.get("fqn") if i["kind"] == "param" else None for i in inputs]:
            fail(where, "'backward_outputs' does not match the forward inputs")
        if meta.get("grad_reductions_owed") != {}:
            fail(where, "this runtime performs no gradient reductions outside the graph")
        static = meta.get("static_input_indices")
        if not isinstance(static, list):
            fail(where, "'static_input_indices' must list forward inputs")
        for i in static:
            check_int(i, f"{where} static_input_indices", 0, len(inputs) - 1)
        plan = meta.get("bucket_plan", [])
        if not isinstance(plan, list):
            fail(where, "'bucket_plan' must be a list of buckets")
        graphs = [meta.get(f"{kind}_graph") for kind in ("forward", "backward")]
        if not all(g is None or isinstance(g, str) for g in graphs):
            fail(where, "graph digests must be strings")
        coords = meta.get("coords")
        if coords is not None and (not isinstance(coords, dict) or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in coords.items())):
            fail(where, f"coordinates {coords!r} are not a mesh place")
        buffers, mutated = _checked_buffers(meta, [i.get("fqn") for i in inputs if i["kind"] == "buffer"], where)
        model_plan = meta.get("model_plan")
        if model_plan is not None and not isinstance(model_plan, dict):
            fail(where, "'model_plan' must be a map")
        rank = meta.get("rank")
        return RankRecord(params=params, forward_inputs=forward_inputs,
                          static_input_indices=tuple(static), saved_activations=saved,
                          saved_bytes=check_int(meta.get("saved_bytes"), f"{where} saved_bytes", 0, 1 << 62),
                          backward_outputs=tuple(outs), bucket_plan=tuple(Bucket.from_json(b, where) for b in plan),
                          rank=None if rank is None else check_int(rank, f"{where} rank", 0, 1 << 16),
                          coords=coords, forward_graph=graphs[0], backward_graph=graphs[1], buffers=buffers,
                          mutated_buffers=mutated, model_plan=model_plan, stage=stage)


def _checked_buffers(meta: dict, input_fqns: list, where: str) -> tuple[tuple[BufferSpec, ...], tuple[str, ...]]:
    """The buffer table names the buffer inputs in order; each is updated by at most one of the
    forward's first outputs."""
    buffers, mutated = meta.get("buffers", []), meta.get("mutated_buffers", [])
    if not isinstance(buffers, list) or not isinstance(mutated, list):
        fail(where, "'buffers' and 'mutated_buffers' must be lists")
    buffers = tuple(BufferSpec.from_json(b, where) for b in buffers)
    names = [b.fqn for b in buffers]
    if names != input_fqns:
        fail(where, "buffer inputs and 'buffers' name different buffers")
    if len(set(map(str, mutated))) != len(mutated) or not set(map(str, mutated)) <= set(names) or not all(
            isinstance(m, str) for m in mutated):
        fail(where, "'mutated_buffers' must name distinct buffers of 'buffers'")
    return buffers, tuple(mutated)


def bind_program(meta, *, rank: int, layout: Layout, where: str, what: str) -> RankRecord:
    """A stored program's metadata bound to `rank`: its coordinates, and each parameter slice
    cut at this rank's coordinate on the dimension the slice names; then checked. `what` names
    the file (for a record that is not a record at all)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("params"), list):
        raise ArtifactError(f"{what} is malformed; rebuild with titan-build")
    coords = layout.coordinates(rank)
    mesh_coords = {name: coords[name] for name, _ in layout.mesh_shape()}
    try:
        params = bound_params(meta["params"], mesh_coords, dict(layout.mesh_shape()), where)
    except ValueError as e:
        raise ArtifactError(f"{e}; rebuild with titan-build") from None
    return RankRecord.from_json(dict(meta, rank=rank, coords=coords, params=params), where)


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm: fx.GraphModule) -> tuple:
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


def check_graphs(record: RankRecord, forward: fx.GraphModule, backward: fx.GraphModule, where: str, *,
                 rank: int, layout: Layout, graph_hashes: dict[str, str], batch_shape: tuple[int, int],
                 vocab_size: int) -> None:
    """The record belongs to this rank and describes these two graphs (`graph_hashes`: the
    sha256 of the forward and backward blobs the manifest gave this rank), and the manifest's
    batch shape (batch size, sequence length) and vocabulary (what the data feeds) are the
    graphs' own."""
    for kind, digest in graph_hashes.items():
        if getattr(record, f"{kind}_graph") != digest:
            # A program's metadata describes its own graphs: mixing programs trains wrong.
            fail(where, f"the manifest gives this rank a {kind} graph that is not its program's "
                        "(a rank must never run another program's graph)")
    if record.coords != layout.coordinates(rank):
        fail(where, f"coordinates {record.coords!r} are not rank {rank}'s place in the mesh")
    inputs, saved = record.forward_inputs, record.saved_activations
    fw_in = _placeholders(forward)
    if len(fw_in) != len(inputs):
        fail(where, f"forward graph takes {len(fw_in)} inputs, metadata lists {len(inputs)}")
    param_specs = iter(record.params)
    buffer_shapes = iter(list(b.shape) for b in record.buffers)
    for node, inp in zip(fw_in, inputs):
        val = node.meta.get("titan_val")
        if inp.kind == "param":
            spec = next(param_specs)
            if not isinstance(val, dict) or val.get("shape") != list(spec.local_shape):
                fail(where, f"forward input {node.name} does not have the shape of parameter {inp.fqn}")
            if val.get("dtype") != (inp.cast or spec.dtype):
                fail(where, f"forward input {node.name} takes parameter {inp.fqn} in {val.get('dtype')}, not "
                            f"in {inp.cast or spec.dtype} as the metadata says")
        if inp.kind == "buffer" and (not isinstance(val, dict) or val.get("shape") != next(buffer_shapes)):
            fail(where, f"forward input {node.name} does not have the shape of buffer {inp.fqn}")
        if inp.kind in ("tokens", "labels") and (not isinstance(val, dict) or val.get("shape") != list(batch_shape)
                                                 or val.get("dtype") != "int64"):
            fail(where, f"the manifest's batch of {batch_shape[0]} x {batch_shape[1]} tokens is not what the "
                        f"forward graph's {inp.kind} input takes ({val})")
        if inp.kind == "activations" and (not isinstance(val, dict) or val.get("shape") != list(record.stage.input_shape)
                                          or val.get("dtype") != record.stage.dtype):
            fail(where, f"stage {record.stage.index} receives {record.stage.dtype} activations of "
                        f"{list(record.stage.input_shape)}, not what its forward graph takes ({val})")
    _check_vocabulary(record, forward, fw_in, vocab_size, where)
    updates = len(record.mutated_buffers)
    if len(_outputs(forward)) != updates + saved + 1:
        fail(where, f"forward graph returns {len(_outputs(forward))} values, expected {updates} buffer updates + "
                    f"loss + {saved} saved")
    if len(_placeholders(backward)) != saved + 1:
        fail(where, f"backward graph takes {len(_placeholders(backward))} inputs, expected {saved} saved + 1")
    if len(_outputs(backward)) != len(inputs):
        fail(where, f"backward graph returns {len(_outputs(backward))} values for {len(inputs)} forward inputs")
    param_specs = iter(record.params)
    for inp, out in zip(inputs, _outputs(backward)):
        if inp.kind != "param":
            continue
        spec, val = next(param_specs), getattr(out, "meta", {}).get("titan_val")
        # A gradient is the parameter's, or its copy's (the runtime upcasts it: param_copies.py).
        if not isinstance(val, dict) or val.get("shape") != list(spec.local_shape) or \
                val.get("dtype") not in (spec.dtype, inp.cast):
            fail(where, f"the backward graph's gradient of {inp.fqn} ({val}) is neither in its dtype nor in its "
                        "copy's, or not of its shape")
    if record.stage is not None and record.stage.output_shape is not None:
        # What a stage sends is what the next stage's receive buffer is made for: the same shape.
        val = getattr(_outputs(forward)[updates], "meta", {}).get("titan_val")
        if (not isinstance(val, dict) or val.get("shape") != list(record.stage.output_shape)
                or val.get("dtype") != record.stage.dtype):
            fail(where, f"stage {record.stage.index} sends {record.stage.dtype} activations of "
                        f"{list(record.stage.output_shape)}, not what its forward graph returns ({val})")


def _source(node, steps: int = 32):
    """The placeholder a value is computed from along its first inputs (a parameter through its
    all-gather and views, the tokens through the vocab-parallel mask), or None."""
    for _ in range(steps):
        if node.op == "placeholder":
            return node
        node = next((a for a in node.args if hasattr(a, "op")), None)
        if node is None:
            return None
    return None


def _check_vocabulary(record: RankRecord, forward: fx.GraphModule, inputs: list, vocab_size: int, where: str) -> None:
    """Each embedding lookup of the tokens reads a table of exactly the manifest's vocabulary:
    the data feeds token ids below vocab_size, and a larger one would index past the table."""
    by_node = dict(zip(inputs, record.forward_inputs))
    params = {p.fqn: p for p in record.params}
    for node in forward.graph.nodes:
        if node.op != "call_function" or str(node.target) != "aten.embedding.default" or len(node.args) < 2:
            continue
        table, ids = (by_node.get(_source(a)) if hasattr(a, "op") else None for a in node.args[:2])
        if table is None or ids is None or table.kind != "param" or ids.kind != "tokens":
            continue
        rows = params[table.fqn].global_shape[0]
        if rows != vocab_size:
            fail(where, f"the manifest's vocabulary of {vocab_size} tokens is not the {rows} rows of the "
                        f"embedding {table.fqn}")

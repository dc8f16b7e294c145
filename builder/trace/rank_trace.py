"""Trace one rank: fake process group + fake tensors -> joint graph -> partition -> blobs.

Each rank is traced in a fresh process (see build.py): re-initializing the fake process group
in one process leaves DTensor sharding-propagation caches keyed on a mesh whose equality
ignores the rank, which silently bakes rank 0's coordinates into later ranks' graphs.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan.builder.passes.checkpointing import tag_activation_checkpointing
from titan.builder.models.decoder import ScaledTokenLoss
from titan.builder.models.decoder_stage import DecoderStage
from titan.builder.models.spec import RankPlace
from titan.builder.trace.parallelize import parallelize
from titan.builder.passes.registry import PASSES, PassContext
from titan.builder.trace.job import RankJob, RankResult
from titan.builder.trace.rank_progress import report
from titan.runtime.contract.graph_encode import encode_graph
from titan.runtime.contract.layout import mesh_dims_by_group
from titan.runtime.contract.rank_record import BufferSpec, GraphInput, RankRecord, StageIO
from titan.runtime.stage_gather import gather_once

PARTITION_FNS = {"min_cut": min_cut_rematerialization_partition, "default": default_partition}


def _desc_input(desc, data_kinds: tuple[str, ...]) -> GraphInput:
    """Describe a joint-graph placeholder from its AOT descriptor (kind "tangent": the
    backward's, which the partitioner leaves out of the forward's inputs); `data_kinds`: what the
    traced module's data inputs are, in order (tokens and labels; a pipeline stage's differ)."""
    name = type(desc).__name__
    if name == "ParamAOTInput":
        return GraphInput(kind="param", fqn=desc.target)
    if name == "BufferAOTInput":
        return GraphInput(kind="buffer", fqn=desc.target)
    if name == "PlainAOTInput":
        return GraphInput(kind=data_kinds[desc.idx])
    if name == "TangentAOTInput":
        return GraphInput(kind="tangent")
    raise ValueError(f"unexpected graph input {desc}")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy (nodes and meta dicts copied, tensors in meta shared): deepcopy
    would clone fake tensors, which fails while the export's fake mode is active. Lazy (as
    every graph module of a trace: see _trace_depth) where the caller asked for lazy ones."""
    graph = fx.Graph()
    out_val = graph.graph_copy(gm.graph, {})
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(out_val).meta.update(old_output.meta)
    return _make_graph_module(gm, graph)


def lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` generating its Python code only when it is first needed (the partitioner returns
    eager graph modules; each pass's recompile would otherwise generate it again)."""
    return gm if isinstance(gm, _LazyGraphModule) else _LazyGraphModule.from_graphmodule(gm)


@contextlib.contextmanager
def module_provenance(model: torch.nn.Module):
    """Record on every traced node (meta['custom']['module']) the module that produced it.

    Hooks are prepended so that a parallel style's input redistribution (its own pre-hook) is
    attributed to the module it serves. Backward nodes inherit their forward node's record.
    """
    open_annotations: list = []

    def enter(_mod, _args, _path):
        cm = fx_traceback.annotate({"module": _path})
        cm.__enter__()
        open_annotations.append(cm)

    def leave(_mod, _args, _out):
        open_annotations.pop().__exit__(None, None, None)

    handles = []
    for path, mod in model.named_modules():
        if path:
            handles.append(mod.register_forward_pre_hook(lambda m, a, _p=path: enter(m, a, _p), prepend=True))
            handles.append(mod.register_forward_hook(leave))
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        for h in handles:
            h.remove()


def trace_rank(job: RankJob) -> list[RankResult]:
    """Trace `job.rank` at each of `job.depths`: one process group and one mesh for all of them
    (one rank, so DTensor's caches stay right; see the module docstring). A second mesh would
    create new process groups, while DTensor's sharding cache, which compares meshes without
    their group names, hands the traces the first mesh's collectives."""
    layout = job.build.layout
    report(job.rank, "tracing")
    if layout.world_size > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=job.rank, world_size=layout.world_size)
    try:
        mesh = layout.build_mesh("cpu")
        results = []
        for depth in job.depths:
            if results:
                # A trace process runs without the cyclic collector (rank_job.py): what the last
                # depth left in cycles goes before the next one is traced.
                gc.collect()
            results.append(_trace_depth(job, mesh, depth))
        return results
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _trace_depth(job: RankJob, mesh, depth: int | None) -> RankResult:
    build, rank = job.build, job.rank
    layout = build.layout
    t0 = time.perf_counter()
    coords = layout.coordinates(rank)
    family = build.model_spec
    cfg = build.cfg if depth is None else replace(build.cfg, n_layers=depth)
    with torch.device("meta"):
        model = family.build(cfg)
    if build.stage is not None:
        # A stage traces its own blocks only: the others are neither parallelized nor materialized
        # (405B at pp 16: 8 blocks of 126 per stage). The kept blocks keep their names.
        model.layers = torch.nn.ModuleDict({str(i): model.layers[str(i)] for i in range(*build.stage.layers)})
    model.loss_scale = float(build.batch_size * build.seq_len * layout.dp_degree)
    shards = parallelize(model, layout, mesh, coords, tp_plan=family.tp_plan, expert_param=family.expert_param,
                         compute_dtype=getattr(torch, build.dtype))
    model_plan = family.place_rank(model, RankPlace(layout=layout, mesh=mesh, batch_size=build.batch_size,
                                                    seq_len=build.seq_len, capacity_factor=build.moe_capacity))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        model.to_empty(device="cpu")
        traced, examples, data_kinds = _traced_module(build, model)
    # A stage's data after what it receives goes by keyword (its forward's optional `tokens`,
    # `labels`); the export numbers the inputs in this order either way.
    args, kwargs = (examples, {}) if build.stage is None else (examples[:1], dict(zip(data_kinds[1:], examples[1:])))
    with contextlib.ExitStack() as stack:
        stack.enter_context(module_provenance(traced))
        # Graph modules generate their Python code when it is first needed, not at each change
        # (the partitioner and the passes would generate it ~9 times per trace, and nothing here
        # runs them): ~10-14% of a trace (issue 30).
        stack.enter_context(_use_lazy_graph_module(True))
        joint = aot_export_joint_with_descriptors(stack, traced, args, kwargs)
        t_export = time.perf_counter()
        report(rank, "partitioning")
        gm = joint.graph_module
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        joint_inputs = [_desc_input(n.meta["desc"], data_kinds) for n in placeholders]
        mutated = mutated_buffers(gm)
        # The partitioners rewrite the joint graph in place: give them a copy.
        joint_copy = copy_graph_module(gm)
        tag_activation_checkpointing(joint_copy, build.ac, ac_block=family.ac_block)
        # The forward returns the buffers' new values first, then the loss.
        fw, bw = map(lazy, PARTITION_FNS[build.partitioner](joint_copy, None, num_fwd_outputs=len(mutated) + 1))
        t_partition = time.perf_counter()
        groups = mesh_dims_by_group(mesh)
        param_names = [inp.fqn if inp.kind == "param" else None for inp in joint_inputs if inp.kind != "tangent"]
        fw_ctx = PassContext(graph="forward", model=family, mesh_dims=groups, input_names=param_names,
                             output_names=[])
        bw_ctx = PassContext(graph="backward", model=family, mesh_dims=groups, input_names=[],
                             output_names=param_names, input_casts=fw_ctx.input_casts)  # fold_param_casts
        for name in build.graph_passes:
            fw, bw = PASSES[name].fn(fw, ctx=fw_ctx), PASSES[name].fn(bw, ctx=bw_ctx)
        t_passes = time.perf_counter()
    # Encode after the export context (and its fake mode) has closed: constants are real.
    report(rank, "writing")
    fw_blob = encode_graph(fw, group_names=groups)
    bw_blob = encode_graph(bw, group_names=groups)
    meta = _rank_meta(job, family.init_specs(cfg), coords, shards, joint_inputs, fw, bw,
                      mutated=mutated, buffer_metric=family.buffer_metric, casts=fw_ctx.input_casts)
    meta = replace(meta, bucket_plan=tuple(fw_ctx.plan + bw_ctx.plan), model_plan=model_plan,
                   stage=None if build.stage is None else stage_io(build, examples, data_kinds, fw, bw, len(mutated),
                                                                      len(meta.params)))
    t_end = time.perf_counter()
    return RankResult(rank=rank, depth=depth, forward=fw_blob, backward=bw_blob, meta=meta,
                      timings={"export_s": t_export - t0, "partition_s": t_partition - t_export,
                               "passes_s": t_passes - t_partition, "encode_s": t_end - t_passes})


def _traced_module(build, model: torch.nn.Module) -> tuple[torch.nn.Module, tuple, tuple[str, ...]]:
    """What a rank traces (inside the fake mode): the model on (tokens, labels), or a pipeline
    stage of it (build.stage) on what that stage receives (tokens on the first, this rank's
    shard of the activations on the others: sequence parallel shards them over tp), the
    micro-batch's tokens where a later stage needs them (the document mask's ids:
    DecoderStage.reads_tokens) and, on the last, the labels; and the kinds of those inputs."""
    batch = (build.batch_size, build.seq_len)
    labels = torch.empty(*batch, dtype=torch.long)
    if build.stage is None:
        return model, (torch.empty(*batch, dtype=torch.long), labels), ("tokens", "labels")
    stage = build.stage
    module = DecoderStage(model, *stage.layers, first=stage.first, last=stage.last, seq_len=build.seq_len,
                          loss_fn=ScaledTokenLoss(model.loss_scale))
    if stage.first:
        received, kinds = torch.empty(*batch, dtype=torch.long), ("tokens",)
    else:
        shape = (build.batch_size, build.seq_len // build.layout.tp, build.cfg.dim)
        received, kinds = torch.empty(shape, dtype=getattr(torch, build.dtype), requires_grad=True), ("activations",)
    examples = (received,)
    if module.reads_tokens:
        examples, kinds = examples + (torch.empty(*batch, dtype=torch.long),), kinds + ("tokens",)
    return (module, examples + (labels,), kinds + ("labels",)) if stage.last else (module, examples, kinds)


def stage_io(build, examples: tuple, data_kinds: tuple[str, ...], fw: fx.GraphModule, bw: fx.GraphModule,
             n_updates: int, n_params: int) -> StageIO:
    """A traced stage's place in the pipeline, the activations it receives and sends (what its
    forward returns after the buffer updates, unless it is the last) and what its gathered values
    hold when titan-run gathers them once per step (runtime/stage_gather.py)."""
    stage = build.stage
    received = examples[data_kinds.index("activations")] if "activations" in data_kinds else None
    sent = None if stage.last else next(n for n in fw.graph.nodes if n.op == "output").args[0][n_updates].meta["val"]
    dtype = str((received if received is not None else sent).dtype).removeprefix("torch.")
    gathered = gather_once(fw, bw, n_params=n_params)
    return StageIO(index=stage.index, stages=stage.stages, layers=stage.layers,
                   input_shape=None if received is None else tuple(received.shape),
                   output_shape=None if sent is None else tuple(sent.shape), dtype=dtype,
                   reads_tokens=not stage.first and "tokens" in data_kinds,
                   gathered_bytes=gathered.resident_bytes, gathered_saved_bytes=gathered.saved_value_bytes)


def mutated_buffers(gm: fx.GraphModule) -> list[str]:
    """The buffers the forward updates in place, in the order the exported graph returns their
    new values (before the loss): a runtime copies them back after the step."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").meta["desc"]
    mutated = []
    for desc in outputs:
        if type(desc).__name__ != "InputMutationAOTOutput":
            continue
        inp = desc.mutated_input
        if type(inp).__name__ != "BufferAOTInput":
            raise ValueError(f"the model's forward updates {inp} in place; only buffers may be (parameters "
                             "change in the optimizer step)")
        mutated.append(inp.target)
    return mutated


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    return 0


def saved_activation_bytes(saved: list, placeholders: list[fx.Node], inputs: list[GraphInput]) -> int:
    """Bytes of what the forward saves for the backward, less the parameters and buffers it
    saves as they are (the graph's own inputs: held once, in the parameter state, however many
    micro-batches a pipeline stage holds; with activation checkpointing most of what a MoE block
    saves is its expert weights)."""
    state = {node for node, inp in zip(placeholders, inputs) if inp.kind in ("param", "buffer")}
    return sum(_nbytes(v.meta.get("val")) for v in saved if v not in state)


def _rank_meta(job: RankJob, specs: dict[str, dict], coords: dict, shards, joint_inputs: list[GraphInput],
               fw: fx.GraphModule, bw: fx.GraphModule, *, mutated: list[str], buffer_metric,
               casts: dict[int, str]) -> RankRecord:
    """`casts`: forward input index -> the dtype the forward takes that parameter in
    (builder/passes/param_casts.py)."""
    by_fqn = {s.fqn: s for s in shards}
    fw_inputs = [inp for inp in joint_inputs if inp.kind != "tangent"]
    fw_inputs = [replace(inp, cast=casts[i]) if i in casts else inp for i, inp in enumerate(fw_inputs)]
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(fw_inputs), (len(placeholders), len(fw_inputs))
    fw_outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0][len(mutated):]
    n_saved = len(fw_outputs) - 1
    bw_in = [n for n in bw.graph.nodes if n.op == "placeholder"]
    assert len(bw_in) == n_saved + 1 and bw_in[-1].name.startswith("tangents"), [n.name for n in bw_in[-3:]]
    bw_outputs = next(n for n in bw.graph.nodes if n.op == "output").args[0]
    assert len(bw_outputs) == len(fw_inputs)
    params = tuple(by_fqn[inp.fqn].spec(specs[inp.fqn]) for inp in fw_inputs if inp.kind == "param")
    # Buffers are state: zeros at the start, checkpointed, updated after each step from the
    # forward's first outputs (one per name in mutated_buffers).
    buffers = tuple(BufferSpec(fqn=inp.fqn, shape=tuple(node.meta["val"].shape),
                               dtype=str(node.meta["val"].dtype).removeprefix("torch."), metric=buffer_metric(inp.fqn))
                    for node, inp in zip(placeholders, fw_inputs) if inp.kind == "buffer")
    assert set(mutated) <= {b.fqn for b in buffers}, mutated
    grads = tuple(inp.fqn if inp.kind == "param" else None for inp in fw_inputs)
    for inp, fqn, out in zip(fw_inputs, grads, bw_outputs):
        # A pipeline stage's received activations have a gradient too: it is sent back.
        assert (fqn is None and inp.kind != "activations") == (out is None), f"gradient presence mismatch for {fqn}"
    # Every data- and tensor-parallel reduction is inside the backward graph (grad_reductions_owed {}).
    return RankRecord(rank=job.rank, coords=coords, params=params, forward_inputs=tuple(fw_inputs),
                      static_input_indices=tuple(i for i, inp in enumerate(fw_inputs) if inp.kind in ("param", "buffer")),
                      saved_activations=n_saved, saved_bytes=saved_activation_bytes(fw_outputs[1:], placeholders, fw_inputs),
                      backward_outputs=grads, buffers=buffers, mutated_buffers=tuple(mutated))

"""Readable listing of one rank's graph: nodes, ops, shapes, module paths, collectives marked,
inputs and outputs named from the rank metadata. Reads graph documents only (no torch import)."""

from __future__ import annotations

from titan.runtime.contract.artifact import Artifact
from titan.runtime.contract.bindings import Binding
from titan.runtime.contract.graph_doc import BIND, DEVICE, DTYPE, GROUP, NODE, TUPLE
from titan.runtime.contract.node_fields import read_printable_doc
from titan.runtime.contract.rank_record import RankRecord

_C10D = "_c10d_functional."


def _fmt_val(val) -> str:
    if isinstance(val, dict) and "shape" in val:
        dims = ",".join(map(str, val["shape"]))
        return f"{val['dtype']}[{dims}]"
    if isinstance(val, dict) and "int" in val:
        return f"int={val['int']}"
    if isinstance(val, list):
        return "(" + ", ".join(_fmt_val(v) for v in val) + ")"
    return "-"


def _fmt_bind(spec: dict, coords: dict[str, int]) -> str:
    """A bound value as this rank sees it, and where it comes from: '1024 (= 0 + 1024*tp)'."""
    binding = Binding.from_json(spec, "titan-show")
    terms = " + ".join([str(binding.base)] + [f"{a}*{d}" for d, a in binding.coef.items()])
    return f"{binding.value(coords, 'titan-show')} (= {terms})"


def _fmt_arg(a, coords: dict[str, int]) -> str:
    if isinstance(a, dict) and len(a) == 1:
        (k, v), = a.items()
        if k == NODE:
            return f"%{v}"
        if k == BIND:
            return _fmt_bind(v, coords)
        if k == TUPLE:
            return "(" + ", ".join(_fmt_arg(x, coords) for x in v) + ")"
        if k == GROUP:
            return f"group={v}"
        if k == DTYPE:
            return v
        if k == DEVICE:
            return "device"
        return str(v)
    if isinstance(a, list):
        return "[" + ", ".join(_fmt_arg(x, coords) for x in a) + "]"
    return repr(a)


def list_graph(art: Artifact, rank: int, kind: str, *, stage: int | None = None) -> list[str]:
    """`stage`: one of the rank's pipeline stages (default: its only program, or its first stage)."""
    rel, meta = getattr(art.rank_entry(rank, stage=stage), kind), art.rank_record(rank, stage=stage)
    coords = art.rank_coordinates(rank)

    def fmt(a) -> str:
        return _fmt_arg(a, coords)

    doc = read_printable_doc(art.read_verified(rel))
    nodes = doc["nodes"]
    sha = art.graph_hash(rank, kind, stage=stage)
    n_saved = meta.saved_activations
    io = meta.stage
    if kind == "forward":
        names = [inp.fqn or inp.kind for inp in meta.forward_inputs]
    else:
        sent = "the loss" if io is None or io.last else "the activations sent on"
        names = [f"saved activation {i}" for i in range(n_saved)] + [f"tangent of {sent}"]
    of = "" if io is None else f" stage {io.index} (layers {io.layers[0]}-{io.layers[1] - 1})"
    lines = [f"{kind} graph of rank {rank}{of} {meta.coords}: {len(nodes)} nodes, blob {sha[:12]}"]
    collectives = 0
    placeholder = 0
    for i, n in enumerate(nodes):
        op = n.get("op")
        module = f"  [{n['module']}]" if n.get("module") else ""
        if op == "placeholder":
            label = names[placeholder] if placeholder < len(names) else "?"
            placeholder += 1
            lines.append(f"  %{i:<5} input  {n['name']:<28} {_fmt_val(n.get('val')):<24} {label}")
        elif op == "output":
            outs = n["args"][0]
            items = outs.get(TUPLE, outs) if isinstance(outs, dict) else outs
            lines.append(f"  %{i:<5} output {len(items)} values")
            if kind == "forward":
                mutated = meta.mutated_buffers
                if mutated:  # the buffers' new values come first (runtime/buffer_state.py)
                    lines.append("         buffer updates: "
                                 + ", ".join(f"{fqn}={fmt(x)}" for fqn, x in zip(mutated, items)))
                items = items[len(mutated):]
                lines.append(f"         loss = {fmt(items[0])}; saved for backward ({n_saved}): "
                             + ", ".join(fmt(x) for x in items[1:]))
            else:
                grads = [f"{fqn}={fmt(x)}" for fqn, x in zip(meta.backward_outputs, items) if fqn]
                lines.append("         gradients: " + ", ".join(grads))
        else:
            target = n.get("target", "")
            mark = "**" if target.startswith(_C10D) and "wait_tensor" not in target else "  "
            collectives += mark == "**"
            args = ", ".join(fmt(a) for a in n.get("args", []))
            kwargs = ", ".join(f"{k}={fmt(v)}" for k, v in (n.get("kwargs") or {}).items())
            call = f"{target}({args}{', ' if args and kwargs else ''}{kwargs})"
            lines.append(f"{mark}%{i:<5} {_fmt_val(n.get('val')):<24} = {call}{module}")
    lines.append(f"{collectives} collectives (marked **)")
    lines += list_bucket_plan(meta, kind)
    return lines


def list_rank_plan(art: Artifact, rank: int) -> list[str]:
    """What a model decided for this rank beyond its graphs: which routed experts it holds (its
    parameters sliced over ep) and the model's plan record (a mixture of experts' dispatch:
    tokens, capacity, buffer rows), plus the buffers it keeps as state. Nothing for a model
    without experts or buffers."""
    meta = art.rank_record(rank)
    lines = []
    if art.manifest.pipeline is not None:
        pp = meta.coords["pp"]
        lines.append(f"pipeline: this rank is pp rank {pp}, running stage(s) "
                     f"{', '.join(map(str, art.manifest.stages_of(rank)))}; the schedule of every pp rank:")
        lines += art.manifest.pipeline.schedule.table()
    experts = [p for p in meta.params if p.placements.get("ep", "R").startswith("S")]
    if experts:
        total, ep = experts[0].global_shape[0], art.layout.ep
        coord, per_rank = meta.coords["ep"], total // ep
        # Expert tensor parallelism (--etp) also cuts every expert's hidden width over tp.
        split = (f"; each expert's hidden width split over tp, tp coordinate {meta.coords['tp']} of {art.layout.tp}"
                 if experts[0].placements.get("tp", "R").startswith("S") else "")
        lines.append(f"expert placement: routed experts {coord * per_rank}..{(coord + 1) * per_rank - 1} of {total} "
                     f"on this rank (ep coordinate {coord} of {ep}; {len(experts)} expert parameters{split})")
    if meta.model_plan:
        lines.append("model plan: " + ", ".join(f"{k} {v}" for k, v in meta.model_plan.items()))
    lines += list_moe_capacity(art, rank)
    if meta.buffers:
        fed = [b for b in meta.buffers if b.metric]
        lines.append(f"buffers: {len(meta.buffers)} (state, zeros at start, checkpointed), "
                     f"{len(meta.mutated_buffers)} updated by each step, {len(fed)} feeding the per-step "
                     "expert-load metrics")
    return lines


def list_moe_capacity(art: Artifact, rank: int) -> list[str]:
    """A bounded MoE dispatch (titan-build --moe-capacity): the capacity, what an overflow does,
    and the memory it saves against the dropless program."""
    capacity = art.manifest.moe_capacity
    if capacity is None:
        return []
    if capacity.drop:
        return [f"moe capacity: factor {capacity.factor:g}, drop-and-pad: assignments past a block's capacity are "
                "dropped (numerics change; dropped_tokens in the metrics)"]
    from titan.runtime.contract.memory_estimate import capacity_saving
    return [f"moe capacity: factor {capacity.factor:g}, dropless: an overflowing micro-batch is redone by the dropless "
            "program the artifact carries",
            "memory: " + capacity_saving(art.rank_record(rank), art.rank_record(rank, redo=True))]


def list_bucket_plan(meta: RankRecord, kind: str) -> list[str]:
    """The rank's collective buckets in this graph (from the bucketing passes), one per line."""
    plan = [b for b in meta.bucket_plan if b.graph == kind]
    if not plan:
        return [f"bucket plan ({kind}): none (every collective on its own)"]
    lines = [f"bucket plan ({kind}): {len(plan)} buckets"]
    for b in plan:
        lines.append(f"  {b.kind.replace('_', '-'):<14} on {b.group:<12} {b.block:<16} "
                     f"{len(b.params):>3} params {b.elements:>13,} elements {b.dtype:<9} "
                     f"{b.bytes / 2**20:>9.2f} MiB: {', '.join(p.removeprefix(b.block + '.') for p in b.params)}")
    return lines

"""A deep model's program from shallow traces (the fitting itself: builder/program/stamp.py).

Each probe rank is traced at STAMP_DEPTHS (3, 4 and 5 layers; rank 0 also at
STAMP_CHECK_DEPTH, 6), the probes of each depth make one program with bindings
(builder/program/bind.py), and the three programs are fitted as one repeated block and evaluated at
the model's depth. Before that, the fit evaluated at depth 6 must equal rank 0's own trace at
depth 6 (graphs, constants and metadata), every binding at rank 0's value: a model whose
layers do not repeat exactly stops there, and the build traces it at full depth instead.

A 126-layer Llama 3 405B so costs 12 layers of tracing per probe (18 for rank 0) instead of
126, and the program is the same one a full-depth trace gives (tests/e2e/test_deep_program_build.py
checks it node for node at 7 layers).
"""

from __future__ import annotations

import msgpack

from titan.builder.program.bind import Program, one_program, program_meta
from titan.builder.program.stamp import STAMP_CHECK_DEPTH, STAMP_DEPTHS, NotStampable, fit_program
from titan.runtime.contract.graph_doc import BIND, read_doc
from titan.runtime.contract.rank_record import bind_program


def _depths(spec) -> tuple[tuple[int, ...], int]:
    """The shallow depths and the check depth for this model: its leading blocks (which differ
    from the repeated one, ModelSpec.leading_layers) are kept in every shallow trace."""
    lead = spec.model_spec.leading_layers(spec.cfg)
    return tuple(lead + d for d in STAMP_DEPTHS), lead + STAMP_CHECK_DEPTH


def stampable(spec) -> bool:
    """Whether fitting from shallow traces can pay: a model deeper than the depths it traces."""
    # A pipeline stage is traced whole: it holds few of the model's blocks.
    return spec.stage is None and getattr(spec.cfg, "n_layers", 0) > _depths(spec)[1]


def _at_rank_zero(value):
    """A program document with every binding at its base (rank 0's value)."""
    if isinstance(value, dict):
        if set(value) == {BIND}:
            return value[BIND]["base"]
        return {k: _at_rank_zero(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_at_rank_zero(v) for v in value]
    return value


def _without_init(meta) -> dict:
    """Program metadata (a RankRecord) as JSON without the parameters' init specs: they follow
    the layer index in ways no affine fit does (depth-scaled std), and the model's spec gives
    them exactly."""
    meta = meta.to_json()
    return dict(meta, params=[dict(p, init=None) for p in meta["params"]])


def _checking_probes(layout, probes: list[int]) -> set[int]:
    """The probes that only check the bindings (bind.probe_ranks' far corner): not rank 0 and not
    at coordinate 1 of one dimension, where the bindings are read."""
    def is_unit(rank: int) -> bool:
        coords = layout.coordinates(rank)
        return sum(coords.values()) == 1
    return {r for r in probes if r != 0 and not is_unit(r)}


def deep_program(tracer, spec, probes: list[int]) -> Program:
    """The program of every rank at the model's full depth; NotStampable or NotOneProgram when
    the shallow traces do not give it (the caller traces at full depth).

    The far corner checks at the first shallow depth only that the bindings read from rank 0
    and the unit probes add up: every depth's program takes its bindings from those alone, the
    deeper ones only repeat the middle block the first depth holds (and the fit checks that
    they do), and the corner's other two traces were an eighth of DeepSeek-V3 671B's build."""
    layout = spec.layout
    depths, check_depth = _depths(spec)
    checking = _checking_probes(layout, probes)

    def traced_depths(rank: int) -> tuple[int, ...]:
        if rank in checking:
            return depths[:1]
        return depths + ((check_depth,) if rank == probes[0] else ())
    tracer.trace(probes, depths=traced_depths)
    shallow = [one_program(layout, [tracer.traces[r, d] for r in probes if d == depths[0] or r not in checking])
               for d in depths]
    fitted = fit_program(list(depths), [read_doc(p.forward) for p in shallow],
                         [read_doc(p.backward) for p in shallow], [_without_init(p.meta) for p in shallow])
    check = tracer.traces[probes[0], check_depth]
    forward, backward, meta = (_at_rank_zero(x) for x in fitted.at(check_depth))
    for what, fit, traced in (("forward graph", forward, read_doc(check.forward)),
                              ("backward graph", backward, read_doc(check.backward)),
                              ("metadata", meta, _without_init(program_meta(check.meta, layout)))):
        if fit != traced:
            raise NotStampable(f"the {what} fitted from depths {depths[0]}-{depths[-1]} differs from "
                               f"rank 0's trace at depth {check_depth}")
    forward, backward, meta = fitted.at(spec.cfg.n_layers)
    init = spec.model_spec.init_specs(spec.cfg)
    meta["params"] = [dict(p, init=init[p["fqn"]]) for p in meta["params"]]
    # As a record: bound to rank 0 (which checks it as the runtime will), then a program again.
    meta = program_meta(bind_program(meta, rank=0, layout=layout, where="the fitted program",
                                     what="the fitted program's metadata"), layout)
    fw_blob, bw_blob = msgpack.packb(forward, use_bin_type=True), msgpack.packb(backward, use_bin_type=True)
    return Program(forward=fw_blob, backward=bw_blob, meta=meta,
                   bindings=sum(blob.count(BIND.encode()) for blob in (fw_blob, bw_blob)))

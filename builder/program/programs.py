"""Which programs a build makes: one program fitted from shallow traces for a deep model, else
one program with bindings from the probe ranks, else (ranks that truly differ) one program per
class of ranks, every rank traced."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan.builder.spec.build_spec import BuildSpec
    from titan.builder.trace.cached import CachedTracer


def make_programs(tracer: CachedTracer, spec: BuildSpec) -> tuple[list, list[int], str]:
    """(programs, program index per rank, a note on how the build deviated from one program
    fitted from shallow traces, or '')."""
    from titan.builder.program.deep import deep_program, stampable
    from titan.builder.program.bind import NotOneProgram, one_program, probe_ranks, program_classes
    from titan.builder.program.stamp import NotStampable

    layout = spec.layout
    probes = probe_ranks(layout)
    note = ""
    if stampable(spec):
        try:
            return [deep_program(tracer, spec, probes)], [0] * layout.world_size, ""
        except (NotStampable, NotOneProgram) as e:
            note = f"the shallow traces do not extrapolate ({e}): traced at full depth; "
    tracer.trace(probes)
    try:
        program = one_program(layout, [tracer.traces[r, None] for r in probes])
        return [program], [0] * layout.world_size, note.removesuffix("; ")
    except NotOneProgram as e:
        tracer.trace([r for r in range(layout.world_size) if (r, None) not in tracer.traces])
        programs, assignment = program_classes(layout, [t for (r, d), t in tracer.traces.items() if d is None])
        return programs, assignment, f"{note}the ranks are not one program ({e}): traced every rank"

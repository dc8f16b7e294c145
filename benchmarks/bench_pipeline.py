"""The pipeline layouts of train_bench.py, defined once for every row that runs them: titan's
artifact, titan's eager reference, the plain-PyTorch peer and torchtitan.

A pipeline layout (`pp2`, `pp2-zbv`, `pp2-tp2`, `pp4`, ...) is a mesh (train_bench.LAYOUTS,
with `pp`) and a schedule (PP_SCHEDULES). Every row runs the same pipeline: the same schedule
class, `--microbatches` micro-batches of `--batch-size` sequences per step, and the same stage
split, titan's (the cost-balanced split titan-build computes by default, builder/spec/
pipeline_spec.py), given to titan-build with --pp-split, to torch.distributed.pipelining as the
stages' layer spans, and to torchtitan as `module_fqns_per_model_part` (torchtitan's own
default split weighs the embedding and the output as one block each; titan's counts the output
projection's FLOPs, a few blocks' worth at a 128K vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

PP_SCHEDULES = {"pp2": "1f1b", "pp2-gpipe": "gpipe", "pp2-interleaved": "interleaved-1f1b", "pp2-zbv": "zbv",
                "pp2-tp2": "1f1b", "pp2-fsdp2": "1f1b", "pp4": "1f1b", "pp4-zbv": "zbv"}
"""Each pipeline layout's schedule (titan's --pp-schedule name); its mesh is in train_bench.LAYOUTS."""

TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}
"""titan's schedule names -> torch.distributed.pipelining's (get_schedule_class), which torchtitan's
`parallelism.pipeline_parallel_schedule` takes."""


@dataclass(frozen=True, kw_only=True)
class BenchPipeline:
    pp: int
    schedule: str
    """titan's name (1f1b, gpipe, interleaved-1f1b, zbv)."""
    microbatches: int
    stage_layers: tuple[int, ...]
    """Transformer blocks per stage, first stage first."""
    stages_per_rank: int

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def torch_schedule(self) -> str:
        return TORCH_SCHEDULES[self.schedule]

    def spans(self) -> list[tuple[int, int]]:
        """Each stage's blocks [start, stop)."""
        out, start = [], 0
        for count in self.stage_layers:
            out.append((start, start + count))
            start += count
        return out

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pp rank `pp_rank` holds, in the order torch's schedules take them: one; every
        pp-th (interleaved); or the V of zbv (r and 2 pp - 1 - r), as titan and torchtitan place them."""
        if self.schedule == "zbv":
            return [pp_rank, self.n_stages - 1 - pp_rank]
        return list(range(pp_rank, self.n_stages, self.pp))

    def module_fqns(self) -> list[list[str]]:
        """torchtitan's `module_fqns_per_model_part` for this split (its Llama 3's module names)."""
        last = self.n_stages - 1
        return [(["tok_embeddings"] if s == 0 else []) + [f"layers.{i}" for i in range(*span)]
                + (["norm", "output"] if s == last else []) for s, span in enumerate(self.spans())]

    def titan_flags(self) -> list[str]:
        return ["--microbatches", str(self.microbatches), "--pp-schedule", self.schedule,
                "--pp-split", ",".join(map(str, self.stage_layers))]

    def describe(self) -> str:
        return (f"{self.schedule} ({self.torch_schedule}), {self.microbatches} micro-batches, "
                f"{self.n_stages} stages of {'+'.join(map(str, self.stage_layers))} blocks")


def bench_pipeline(layout_name: str, *, flavor: str, seq_len: int, microbatches: int) -> BenchPipeline | None:
    """The pipeline of train_bench layout `layout_name` (None for a layout without pp), checked
    and split by titan-build's own rules (a ValueError names what cannot work)."""
    if layout_name not in PP_SCHEDULES:
        return None
    from titan.builder.models import model_spec
    from titan.builder.spec.pipeline_spec import make_pipeline
    from titan.runtime.contract.layout import Layout
    from train_bench import LAYOUTS

    cfg = model_spec("llama3").flavors[flavor]
    layout = Layout(**LAYOUTS[layout_name])
    spec = make_pipeline(model="llama3", cfg=cfg, layout=layout, seq_len=seq_len, schedule=PP_SCHEDULES[layout_name],
                         microbatches=microbatches, split=None)
    return BenchPipeline(pp=layout.pp, schedule=spec.schedule, microbatches=spec.microbatches,
                         stage_layers=spec.stage_layers, stages_per_rank=spec.stages_per_rank)


def main() -> None:
    """`python benchmarks/bench_pipeline.py pp2 [--flavor 1B --seq-len 2048 --microbatches 8]`:
    the layout's pipeline, its titan-build flags and torchtitan's module names per stage."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("layout")
    p.add_argument("--flavor", default="1B")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--titan-build-flags", action="store_true",
                   help="print only titan-build's mesh and pipeline flags for the layout (train_bench's own)")
    a = p.parse_args()
    try:
        pipeline = bench_pipeline(a.layout, flavor=a.flavor, seq_len=a.seq_len, microbatches=a.microbatches)
    except ValueError as e:
        raise SystemExit(f"error: {a.layout}: {e}") from None
    if pipeline is None:
        raise SystemExit(f"error: {a.layout} is not a pipeline layout; use one of {', '.join(PP_SCHEDULES)}")
    if a.titan_build_flags:
        from train_bench import LAYOUTS, mesh_flags
        print(" ".join(mesh_flags(LAYOUTS[a.layout]) + pipeline.titan_flags()))
        return
    fqns = ["+".join(f for f in part if not f.startswith("layers.")) or "-" for part in pipeline.module_fqns()]
    print(f"{a.layout}: {pipeline.describe()}; stage ranks "
          f"{[r for s in range(pipeline.n_stages) for r in range(pipeline.pp) if s in pipeline.stages_of(r)]}; "
          f"titan-build {' '.join(pipeline.titan_flags())}; torchtitan module_fqns_per_model_part: blocks "
          f"{pipeline.spans()}, with {fqns}")


if __name__ == "__main__":
    main()

"""The pipeline stages this rank runs, from a pipeline artifact's stage programs: each loaded,
bound and checked like a whole-model program (runtime/rank_graphs.py), its parameters
materialized, and one training step run as the artifact's schedule says
(runtime/pipeline_executor.py): every micro-batch of the step through this rank's stages, the
gradients summed over micro-batches and then divided by their count, as
torch.distributed.pipelining's schedules do (`scale_grads`).

The step's loss is the mean of the last stage's micro-batch losses, summed in micro-batch order;
every pp rank gets it (an all-reduce over the pipeline, the others adding zero), so that rank 0,
which runs the first stage, reports it.

A bounded MoE dispatch that stays dropless (titan-build --moe-capacity F with --pp) redoes an
overflowing forward per stage and micro-batch with the stage's dropless program
(runtime/moe_redo.py): a stage's overflow count is summed over the stage's ranks, which run that
forward together and so take the same branch; a stage that did not overflow gave the dropless
output bit for bit, so every stage's input, and the whole step, is the dropless pipeline's."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from titan.runtime.buffer_state import BufferState
from titan.runtime.contract.artifact import Artifact
from titan.runtime.contract.layout import group_names
from titan.runtime.contract.memory_estimate import check_device, estimate_from_graphs
from titan.runtime.contract.rank_record import BufferSpec, ParamSpec, RankRecord
from titan.runtime.init import materialize
from titan.runtime.kernels.fusion import compile_program_regions
from titan.runtime.moe_redo import OverflowRedo
from titan.runtime.pipeline_executor import run_pipeline_step
from titan.runtime.pipeline_stage import GraphStage
from titan.runtime.stage_gather import StageGather, gather_once
from titan.runtime.stage_reduce import StageReduce, reduce_once
from titan.runtime.rank_graphs import load_rank_graphs
from titan.runtime.startup import rank_phases


class PipelineProgram:
    """This rank's stages (`stages`: stage index -> its program's graphs and record), their
    parameters (`params`, stage after stage, each stage's in its program's order) and the
    schedule."""

    def __init__(self, artifact: Artifact, rank: int, *, device: torch.device, mesh, seed: int,
                 load_param: Callable[[ParamSpec], torch.Tensor] | None = None, params_from: str = "seeded init",
                 load_buffer: Callable[[BufferSpec], torch.Tensor | None] = lambda spec: None,
                 artifact_kernels: bool = False, gather_per_step: bool = True, reduce_per_step: bool = False):
        """`artifact_kernels`: whether the artifact's own kernels are trusted (kernels_trusted);
        `gather_per_step`: each stage gathers its parameters once per step and holds them until its
        last backward (runtime/stage_gather.py; bitwise the same), not in every micro-batch's
        forward (and recomputation) as its stored graphs do; `reduce_per_step`: each stage sums its
        unsharded gradients over the step's micro-batches and reduce-scatters them once, after its
        last backward (runtime/stage_reduce.py: the numerics change);
        `load_buffer`: a model buffer's initial value (None: zeros; runtime/buffer_state.py)."""
        manifest = artifact.manifest
        self.schedule = manifest.pipeline.schedule
        self.layout, self.rank, self.device = artifact.layout, rank, device
        self.records: dict[int, RankRecord] = {}
        self.graphs = {}
        self.gathers: dict[int, StageGather] = {}
        self.reduces: dict[int, StageReduce] = {}
        self.fusion = None
        """The compiled regions of this rank's stages, counted together (the line titan-run prints)."""
        self.redos: dict[int, OverflowRedo] = {}
        """Per stage, its dropless redo (a bounded MoE dispatch that stays dropless)."""
        self.redoes = bool(manifest.redo_programs)
        """Whether the artifact redoes overflowing forwards: the same on every rank (a rank whose
        stages hold no MoE block has no redo of its own but runs the step as the others do)."""
        phases = rank_phases()
        held = manifest.stages_of(rank)
        with phases(f"rank {rank}: loading and checking its stage program(s) {', '.join(map(str, held))}",
                    short="program"):
            groups = group_names(mesh)
            for s in held:
                record = artifact.rank_record(rank, stage=s)
                forward, backward = load_rank_graphs(artifact, rank, device=device, groups=groups, stage=s)
                # Each micro-batch in flight holds its own saved activations (the schedule's peak).
                check_device(estimate_from_graphs(record, forward, backward, dense_flex=device.type != "cuda"),
                             device, name=f"{artifact.root} rank {rank} stage {s}")
                if manifest.redo_programs and (gather_per_step or reduce_per_step):
                    # A redo runs the dropless program's stored graphs in place of the bounded
                    # ones: both must take the parameters alike (gathering in every micro-batch).
                    if reduce_per_step:
                        raise ValueError("--pp-reduce-per-step: this artifact redoes overflowing MoE forwards "
                                         "(--moe-capacity), whose dropless programs reduce in every micro-batch; "
                                         "drop --pp-reduce-per-step or rebuild without --moe-capacity")
                    gather_per_step = False
                if gather_per_step:
                    self.gathers[s] = gather_once(forward, backward, n_params=len(record.params))
                    forward, backward = self.gathers[s].forward, self.gathers[s].backward
                if reduce_per_step and (cut := reduce_once(backward, n_params=len(record.params),
                                                             groups=groups)) is not None:
                    self.reduces[s] = cut
                    backward = cut.compute
                self.fusion = compile_program_regions(forward, backward, device, stats=self.fusion,
                                                      artifact_kernel=artifact.kernel if artifact_kernels else None
                                                      ) or self.fusion
                self.records[s], self.graphs[s] = record, (forward, backward)
                # A stage without MoE blocks (no buffers: DeepSeek-V3's dense first blocks alone) has
                # no dispatch to overflow.
                if manifest.redo_programs and record.buffers:
                    self.redos[s] = self._redo(artifact, rank, s, record, device=device, mesh=mesh,
                                               artifact_kernels=artifact_kernels)
        with phases(f"rank {rank}: materializing its parameters ({params_from})", short="parameters"):
            load_param = load_param or (lambda p: materialize(p, seed=seed, device=device))
            self.stage_params = {s: [load_param(p) for p in record.params] for s, record in self.records.items()}
        self.specs = [p for s in held for p in self.records[s].params]
        self.params = [p for s in held for p in self.stage_params[s]]
        self.coords = self.records[held[0]].coords
        self.pp_rank = self.coords["pp"]
        self.pp_group = mesh.get_group("pp")
        # Every held stage's buffers (a MoE block's balancing bias and load), one state: checkpoints
        # and metrics read them as a whole model's.
        self.buffers = BufferState(*(self.records[s] for s in held), device=device, load=load_buffer)
        # Made once: a zero-bubble schedule's split of each backward is cut on first use and kept.
        self.stages = {s: self._stage(s) for s in held}

    def _redo(self, artifact: Artifact, rank: int, s: int, record: RankRecord, *, device: torch.device, mesh,
              artifact_kernels: bool) -> OverflowRedo:
        """Stage `s`'s dropless redo program, loaded and checked as its bounded one is."""
        forward, backward = load_rank_graphs(artifact, rank, device=device, groups=group_names(mesh), stage=s,
                                             redo=True)
        dropless = artifact.rank_record(rank, stage=s, redo=True)
        # The redo runs while the bounded attempts of other micro-batches are held: it must fit too.
        check_device(estimate_from_graphs(dropless, forward, backward, dense_flex=device.type != "cuda"), device,
                     name=f"{artifact.root} rank {rank} stage {s} (its dropless redo program)")
        # Its regions are compiled as the bounded program's are: both must run the same kernels.
        self.fusion = compile_program_regions(forward, backward, device, stats=self.fusion,
                                              artifact_kernel=artifact.kernel if artifact_kernels else None
                                              ) or self.fusion
        return OverflowRedo(record, dropless, forward, backward, where=f"{artifact.root} rank {rank} stage {s}")

    def step_metrics(self) -> dict:
        """The expert load of this rank's stages' MoE blocks (runtime/buffer_state.py), read after
        the step, and with a dropless redo the micro-batches its stages redid; the logging rank's
        stages only (a read here is no collective)."""
        out = self.buffers.metrics()
        if self.redos:
            counts = [redo.metrics() for redo in self.redos.values()]
            out |= {name: sum(c[name] for c in counts) for name in counts[0]}
        return out

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    def _stage(self, s: int) -> GraphStage:
        record = self.records[s]
        forward, backward = self.graphs[s]
        order = [i.kind for i in record.forward_inputs]
        kinds = tuple(kind for kind in order if kind not in ("param", "buffer"))
        # The traced forward takes the parameters, then the buffers, then the data (aot export's order).
        assert order == sorted(order, key=lambda kind: ("param", "buffer").index(kind) if kind in ("param", "buffer")
                               else 2), order
        buffers = [self.buffers.tensors[i.fqn] for i in record.forward_inputs if i.kind == "buffer"]
        io = record.stage
        return GraphStage(forward=forward, backward=backward, params=self.stage_params[s], inputs=kinds, tokens=(),
                          labels=(), activation_shape=io.input_shape or io.output_shape,
                          dtype=getattr(torch, io.dtype), device=self.device, buffers=buffers,
                          updated=[self.buffers.tensors[fqn] for fqn in record.mutated_buffers],
                          gathered=self.gathers.get(s), reduced=self.reduces.get(s), redo=self.redos.get(s))

    @torch.no_grad()
    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One training step over the step's micro-batches (tokens, labels): sets each
        parameter's .grad to the mean of its micro-batches' gradients; returns the step's loss
        (the mean of the micro-batch losses), the same on every pp rank."""
        assert len(batches) == self.microbatches, (len(batches), self.microbatches)
        stages = self.stages
        for stage in stages.values():
            stage.tokens, stage.labels = tuple(t for t, _ in batches), tuple(lb for _, lb in batches)
            stage.losses.clear()
        run_pipeline_step(self.schedule, pp_rank=self.pp_rank, stages=stages,
                          global_rank=lambda p: self.layout.pipeline_peer(self.rank, p))
        for p in self.params:  # torch.distributed.pipelining's scale_grads: the mean over micro-batches
            p.grad.div_(self.microbatches)
        last = self.schedule.n_stages - 1
        return pipeline_loss([stages[last].losses[m] for m in range(self.microbatches)] if last in stages else None,
                             device=self.device, group=self.pp_group)


def pipeline_loss(losses: list[torch.Tensor] | None, *, device: torch.device, group) -> torch.Tensor:
    """The step's loss on every pp rank: the mean of the last stage's micro-batch losses (summed
    in micro-batch order, then divided by their count), given by the rank that holds the last
    stage (`losses`; None on the others, which add zero). titan's executor and the eager
    reference of titan-verify report it alike."""
    if losses is None:
        total = torch.zeros((), dtype=torch.float32, device=device)
    else:
        total = losses[0].detach().clone()
        for loss in losses[1:]:
            total = total + loss
        total = total / len(losses)
    dist.all_reduce(total, group=group)
    return total

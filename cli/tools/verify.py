"""titan-verify, per rank: train eagerly and from the artifact with the same seed, data and
recipe, and compare the losses and gradient norms bit for bit, step by step, and the
parameters after the last step
(losses alone can hide an optimizer that rounds differently: bf16 compute drops the last bits
of fp32 master weights)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titan.cli.tools.eager import EagerProgram
from titan.cli.tools.verify_reference import drop_capacity
from titan.builder.models import model_spec
from titan.builder.models.spec import ModelConfig, ModelSpec
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.manifest import Manifest
from titan.runtime.distributed import RankEnv, init_process_group, pick_device
from titan.runtime.kernels.artifact_trust import kernels_trusted
from titan.runtime.recipe import Recipe
from titan.runtime.startup import rank_phases
from titan.runtime.run_config import RunConfig
from titan.runtime.pipeline_program import PipelineProgram
from titan.runtime.train import (GraphProgram, compiles_regions, make_data, make_optimizer,
                                 make_validation, pipeline_step, step_functions)
from titan.runtime.train_loop import StepResults, train_loop


def eager_config(manifest: Manifest) -> tuple[ModelSpec, ModelConfig]:
    """The artifact's model, as this titan's model code builds it: its recorded config (a
    flavor, or a shape of the user's own: builder/models/shape.py), held to the family's
    shape rules."""
    spec = model_spec(manifest.model)
    try:
        cfg = spec.config_from_dict(manifest.model_config)
        spec.check_shape(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the artifact's model config is not one this titan's {manifest.model} code can build "
                         f"({e}); rebuild the artifact with this version") from None
    return spec, cfg


def verify_rank(artifact_path: str, cfg: RunConfig, env: RankEnv) -> Verdict:
    """Train eagerly, then from the artifact, with the same recipe; losses are summed over
    data-parallel ranks."""
    art = open_artifact(artifact_path)
    m = art.manifest
    if env.world_size != art.world_size:
        raise ValueError(f"{artifact_path} needs {art.world_size} ranks, this job has {env.world_size}")
    phases = rank_phases()
    recipe = Recipe.for_run(cfg, m)
    device = pick_device(cfg.device, env, deterministic=cfg.deterministic)
    with phases(f"rank {env.rank}: joining the other {env.world_size - 1} rank(s)", short="process group"):
        init_process_group(env, device, timeout_s=cfg.timeout_s)
    layout = art.layout
    mesh = layout.build_mesh(device.type)
    kw = dict(steps=cfg.steps, device=device, mesh=mesh, tokens_per_step=m.tokens_per_step,
              micro_batches=recipe.micro_batches)
    eager_steps: list[dict] = []
    artifact_steps: list[dict] = []

    trusted, note = kernels_trusted(art, cfg.kernel_trust) if compiles_regions(m, device) else (False, "")
    if trusted and device.type == "cuda" and m.model_config.get("attention") == "flex":
        # The eager reference calls the flex op before the artifact's program loads its kernels:
        # it takes them from the artifact too (runtime/kernels/flex_kernels.py).
        from titan.runtime.kernels.flex_kernels import serve_artifact_kernels
        serve_artifact_kernels(art.kernel)
    with phases(f"rank {env.rank}: building the model eagerly and training it {cfg.steps} step(s)", short="eager"):
        if m.pipeline is None:
            eager = EagerProgram(*eager_config(m), layout, env.rank, batch_size=m.batch_size, seq_len=m.seq_len,
                                 device=device, mesh=mesh, seed=cfg.seed, compute_dtype=getattr(torch, m.dtype),
                                 micro_batches=recipe.micro_batches, capacity_factor=drop_capacity(m))
            named, eager_step, eager_pipeline_step = eager.model.named_parameters(), eager.step, None
            named_buffers = eager.model.named_buffers()
        else:
            from titan.cli.tools.eager_pipeline import EagerPipeline
            eager = EagerPipeline(*eager_config(m), layout, env.rank, batch_size=m.batch_size, seq_len=m.seq_len,
                                  device=device, mesh=mesh, seed=cfg.seed, compute_dtype=getattr(torch, m.dtype),
                                  schedule=m.pipeline.schedule, capacity_factor=drop_capacity(m))
            named, eager_step, eager_pipeline_step = eager.named_params, None, eager.step
            named_buffers = eager.named_buffers
        # The reference is torch's own AdamW (its single-tensor path, which titan's AdamW mirrors),
        # LR scheduler and clip_grad_norm_.
        eager_opt = torch.optim.AdamW(eager.params, lr=recipe.schedule.lr, foreach=False, **recipe.adamw)
        scheduler = torch.optim.lr_scheduler.LambdaLR(eager_opt, recipe.schedule.factor)
        coords = layout.coordinates(env.rank)

        def eager_update() -> torch.Tensor:
            norm = eager.clip_grad_norm(recipe.max_norm)
            eager_opt.step()
            scheduler.step()
            return norm

        validation = None if m.pipeline else make_validation(eager.forward_loss, m, cfg, coords, device=device,
                                                             mesh=mesh)
        eager_run = train_loop(eager_step, eager_opt, make_data(m, cfg, coords), update=eager_update,
                               validation=validation, log=eager_steps.append, pipeline_step=eager_pipeline_step, **kw)
        eager_params = {fqn: p.detach().cpu() for fqn, p in named}
        eager_buffers = {fqn: b.detach().cpu() for fqn, b in named_buffers}
        del eager, eager_opt, scheduler, eager_update
        if device.type == "cuda":  # the eager model's blocks go back before the artifact's program takes its own
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    if note and env.rank == 0:
        print(note, flush=True)
    if m.pipeline is None:
        program = GraphProgram(art, env.rank, device=device, mesh=mesh, seed=cfg.seed,
                               micro_batches=recipe.micro_batches, artifact_kernels=trusted)
    else:
        program = PipelineProgram(art, env.rank, device=device, mesh=mesh, seed=cfg.seed, artifact_kernels=trusted,
                                  gather_per_step=cfg.pp_gather_per_step)
    if program.fusion is not None and env.rank == 0:
        print(program.fusion.line(), flush=True)
    if device.type == "cuda" and m.model_config.get("attention") == "flex" and env.rank == 0:
        from titan.runtime.kernels.flex_kernels import origins
        print(f"flex kernels (the eager reference's and the artifact's): {origins()}", flush=True)
    optimizer = make_optimizer(program.params, recipe, device, fused=cfg.fused_adamw,
                               copies=getattr(program, "copies", None))
    with phases(f"rank {env.rank}: training {cfg.steps} step(s) from the artifact", short="artifact"), \
            step_functions(program, cfg, device, recipe, mesh, optimizer) as (step, update, forward_loss):
        graph_run = train_loop(step, optimizer, make_data(m, cfg, program.coords), update=update,
                               validation=make_validation(forward_loss, m, cfg, program.coords, device=device,
                                                          mesh=mesh), log=artifact_steps.append,
                               step_metrics=program.step_metrics if getattr(program, "redo", None) else None,
                               pipeline_step=pipeline_step(program, step), **kw)
    fqns = [p.fqn for p in art.rank_params(env.rank)]
    differ = sum(not torch.equal(eager_params[f], t.detach().cpu()) for f, t in zip(fqns, program.params))
    # The model buffers the forward updates (a MoE's balancing bias and load): every one the artifact holds.
    buffers = program.buffers.tensors
    buffers_differ = sum(f not in eager_buffers or not torch.equal(eager_buffers[f], t.cpu()) for f, t in buffers.items())
    return Verdict(eager=eager_run, artifact=graph_run, device=device, params_differ=differ, params=len(fqns),
                   buffers_differ=buffers_differ, buffers=len(buffers), eager_steps=eager_steps,
                   artifact_steps=artifact_steps)


@dataclass
class Verdict:
    """One rank's two runs: each step's loss and gradient norm, and the parameter tensors that
    differ after the last step (of `params` on this rank)."""
    eager: StepResults
    artifact: StepResults
    device: torch.device
    params_differ: int
    params: int
    buffers_differ: int = 0
    buffers: int = 0
    """Model buffers (runtime/buffer_state.py) on this rank, and how many differ after the last step."""
    eager_steps: list[dict] = field(default_factory=list)
    artifact_steps: list[dict] = field(default_factory=list)
    """Each step's record (loss, tokens_per_s, ...), as titan-run logs them: for the summary."""

    def steps_equal(self) -> bool:
        pairs = [*zip(self.eager.losses, self.artifact.losses), *zip(self.eager.grad_norms, self.artifact.grad_norms),
                 *((a, b) for (_, a), (_, b) in zip(self.eager.val_losses, self.artifact.val_losses))]
        return all(torch.equal(a, b) for a, b in pairs)


def all_ranks_equal(verdict: Verdict) -> tuple[bool, int, int, int]:
    """(bitwise equality of every rank's losses and gradient norms, parameter tensors that
    differ, model buffers that differ, model buffers: on all ranks together)."""
    same = verdict.steps_equal()
    counts = [0 if same else 1, verdict.params_differ, verdict.buffers_differ, verdict.buffers]
    if dist.is_initialized():
        flags = torch.tensor(counts, device=verdict.device)
        dist.all_reduce(flags)
        counts = [int(x) for x in flags]
    return counts[0] == 0, counts[1], counts[2], counts[3]

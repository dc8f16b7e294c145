"""titan-verify, per rank: train eagerly and from the artifact with the same seed and data,
and compare the losses bit for bit, step by step, and the parameters after the last step
(losses alone can hide an optimizer that rounds differently: bf16 compute drops the last bits
of fp32 master weights)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titan.cli.tools.eager import EagerProgram
from titan.builder.models import model_spec
from titan.builder.models.spec import ModelConfig, ModelSpec
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.kernels.artifact_trust import kernels_trusted
from titan.runtime.contract.manifest import Manifest
from titan.runtime.distributed import RankEnv, init_process_group, pick_device
from titan.runtime.startup import rank_phases
from titan.runtime.train import (ADAMW, GraphProgram, RunConfig, compiles_regions, make_data, make_optimizer,
                                 step_function, train_loop)


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


@dataclass(kw_only=True)
class RankVerdict:
    eager: list[torch.Tensor]
    """Eager PyTorch's loss at each step (summed over data-parallel ranks)."""
    artifact: list[torch.Tensor]
    """The artifact's loss at each step (summed over data-parallel ranks)."""
    device: torch.device
    params_differ: int
    """Parameter tensors of this rank that differ after the last step."""
    n_params: int
    """Parameter tensors of this rank."""
    eager_steps: list[dict] = field(default_factory=list)
    artifact_steps: list[dict] = field(default_factory=list)
    """Each step's record (loss, tokens_per_s, ...), as titan-run logs them: for the summary."""


def verify_rank(artifact_path: str, cfg: RunConfig, env: RankEnv) -> RankVerdict:
    """Train eagerly, then from the artifact, and compare this rank's parameters."""
    phases = rank_phases()
    art = open_artifact(artifact_path)
    m = art.manifest
    if env.world_size != art.world_size:
        raise ValueError(f"{artifact_path} needs {art.world_size} ranks, this job has {env.world_size}")
    device = pick_device(cfg.device, env, deterministic=cfg.deterministic)
    with phases(f"rank {env.rank}: joining the other {env.world_size - 1} rank(s)", short="process group"):
        init_process_group(env, device, timeout_s=cfg.timeout_s)
    layout = art.layout
    mesh = layout.build_mesh(device.type)
    tokens_per_step = m.tokens_per_step
    verdict = RankVerdict(eager=[], artifact=[], device=device, params_differ=0, n_params=0)
    kw = dict(steps=cfg.steps, device=device, mesh=mesh, tokens_per_step=tokens_per_step)

    with phases(f"rank {env.rank}: building the model eagerly and training it {cfg.steps} step(s)", short="eager"):
        eager = EagerProgram(*eager_config(m), layout, env.rank, batch_size=m.batch_size, seq_len=m.seq_len,
                             device=device, mesh=mesh, seed=cfg.seed, compute_dtype=getattr(torch, m.dtype))
        # The reference is torch's own AdamW (its single-tensor path, which titan's AdamW mirrors).
        eager_opt = torch.optim.AdamW(eager.params, lr=cfg.lr, foreach=False, **ADAMW)
        verdict.eager = train_loop(eager.step, eager_opt, make_data(m, cfg, layout.coordinates(env.rank)),
                                   log=verdict.eager_steps.append, **kw)
        eager_params = {fqn: p.detach().cpu() for fqn, p in eager.model.named_parameters()}
        del eager, eager_opt
    trusted, note = kernels_trusted(art, cfg.kernel_trust) if compiles_regions(m, device) else (False, "")
    if note and env.rank == 0:
        print(note, flush=True)
    program = GraphProgram(art, env.rank, device=device, mesh=mesh, seed=cfg.seed, artifact_kernels=trusted)
    if program.fusion is not None and env.rank == 0:
        print(program.fusion.line(), flush=True)
    with phases(f"rank {env.rank}: training {cfg.steps} step(s) from the artifact", short="artifact"), \
            step_function(program, cfg, device) as step:
        verdict.artifact = train_loop(step, make_optimizer(program.params, cfg.lr, device, fused=cfg.fused_adamw),
                                      make_data(m, cfg, program.coords), log=verdict.artifact_steps.append, **kw)
    fqns = art.rank_record(env.rank).param_fqns
    verdict.params_differ = sum(not torch.equal(eager_params[f], t.detach().cpu()) for f, t in zip(fqns, program.params))
    verdict.n_params = len(fqns)
    return verdict


def all_ranks_equal(eager: list[torch.Tensor], graph: list[torch.Tensor], device: torch.device,
                    params_differ: int = 0) -> tuple[bool, int]:
    """(bitwise equality of every rank's losses, parameter tensors that differ on all ranks together)."""
    same = all(torch.equal(a, b) for a, b in zip(eager, graph))
    if not dist.is_initialized():
        return same, params_differ
    flags = torch.tensor([0 if same else 1, params_differ], device=device)
    dist.all_reduce(flags)
    return int(flags[0]) == 0, int(flags[1])

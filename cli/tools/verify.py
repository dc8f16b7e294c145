"""titan-verify, per rank: train eagerly and from the artifact with the same seed and data,
and compare the losses bit for bit, step by step, and the parameters after the last step
(losses alone can hide an optimizer that rounds differently: bf16 compute drops the last bits
of fp32 master weights)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan.cli.tools.eager import EagerProgram
from titan.builder.models import model_spec
from titan.builder.models.spec import ModelConfig, ModelSpec
from titan.runtime.artifact import open_artifact
from titan.runtime.contract.manifest import Manifest
from titan.runtime.distributed import RankEnv, init_process_group, pick_device
from titan.runtime.run_config import RunConfig
from titan.runtime.train import ADAMW, GraphProgram, make_data, make_optimizer, step_function, train_loop


def eager_config(manifest: Manifest) -> tuple[ModelSpec, ModelConfig]:
    """The artifact's model, as this titan's model code builds it."""
    spec = model_spec(manifest.model)
    cfg = spec.config_from_dict(manifest.model_config)
    if spec.flavors.get(manifest.flavor) != cfg:
        raise ValueError(f"artifact model config does not match flavor {manifest.flavor!r} of this titan; "
                         "rebuild the artifact with this version")
    return spec, cfg


def verify_rank(artifact_path: str, cfg: RunConfig,
                env: RankEnv) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.device, int, int]:
    """Returns (eager losses, artifact losses, device, parameter tensors that differ after the last
    step, parameter tensors); losses are summed over data-parallel ranks."""
    art = open_artifact(artifact_path)
    m = art.manifest
    if env.world_size != art.world_size:
        raise ValueError(f"{artifact_path} needs {art.world_size} ranks, this job has {env.world_size}")
    device = pick_device(cfg.device, env, deterministic=cfg.deterministic)
    init_process_group(env, device, timeout_s=cfg.timeout_s)
    layout = art.layout
    mesh = layout.build_mesh(device.type)
    tokens_per_step = m.tokens_per_step
    kw = dict(steps=cfg.steps, device=device, mesh=mesh, tokens_per_step=tokens_per_step, log=None)

    eager = EagerProgram(*eager_config(m), layout, env.rank, batch_size=m.batch_size, seq_len=m.seq_len,
                         device=device, mesh=mesh, seed=cfg.seed, compute_dtype=getattr(torch, m.dtype))
    # The reference is torch's own AdamW (its single-tensor path, which titan's AdamW mirrors).
    eager_opt = torch.optim.AdamW(eager.params, lr=cfg.lr, foreach=False, **ADAMW)
    eager_losses = train_loop(eager.step, eager_opt,
                              make_data(m, cfg, layout.coordinates(env.rank)), **kw)
    eager_params = {fqn: p.detach().cpu() for fqn, p in eager.model.named_parameters()}
    del eager, eager_opt
    program = GraphProgram(art, env.rank, device=device, mesh=mesh, seed=cfg.seed)
    if program.fusion is not None and env.rank == 0:
        print(program.fusion.line(), flush=True)
    with step_function(program, cfg, device) as step:
        graph_losses = train_loop(step, make_optimizer(program.params, cfg.lr, device, fused=cfg.fused_adamw),
                                  make_data(m, cfg, program.coords), **kw)
    fqns = art.rank_record(env.rank).param_fqns
    differ = sum(not torch.equal(eager_params[f], t.detach().cpu()) for f, t in zip(fqns, program.params))
    return eager_losses, graph_losses, device, differ, len(fqns)


def all_ranks_equal(eager: list[torch.Tensor], graph: list[torch.Tensor], device: torch.device,
                    params_differ: int = 0) -> tuple[bool, int]:
    """(bitwise equality of every rank's losses, parameter tensors that differ on all ranks together)."""
    same = all(torch.equal(a, b) for a, b in zip(eager, graph))
    if not dist.is_initialized():
        return same, params_differ
    flags = torch.tensor([0 if same else 1, params_differ], device=device)
    dist.all_reduce(flags)
    return int(flags[0]) == 0, int(flags[1])

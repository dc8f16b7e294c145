"""titan-verify, per rank: train eagerly and from the artifact with the same seed and data,
and compare the losses bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan.builder.eager import EagerProgram
from titan.builder.layout import Layout
from titan.builder.models.llama3_config import FLAVORS, LlamaConfig
from titan.runtime.artifact import open_artifact
from titan.runtime.distributed import RankEnv, build_mesh, init_process_group, pick_device
from titan.runtime.train import (ADAMW, GraphProgram, RunConfig, make_data, make_optimizer, step_function,
                                 train_loop)


def eager_config(manifest: dict) -> LlamaConfig:
    cfg = LlamaConfig(**manifest["model_config"])
    if FLAVORS.get(manifest["flavor"]) != cfg:
        raise ValueError(f"artifact model config does not match flavor {manifest['flavor']!r} of this titan; "
                         "rebuild the artifact with this version")
    return cfg


def verify_rank(artifact_path: str, cfg: RunConfig,
                env: RankEnv) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.device]:
    """Returns (eager losses, artifact losses, device); losses are summed over data-parallel ranks."""
    art = open_artifact(artifact_path)
    m = art.manifest
    if env.world_size != art.world_size:
        raise ValueError(f"{artifact_path} needs {art.world_size} ranks, this job has {env.world_size}")
    device = pick_device(cfg.device, env, deterministic=cfg.deterministic)
    init_process_group(env, device, timeout_s=cfg.timeout_s)
    mesh = build_mesh(art.mesh, device)
    layout = Layout(**m["layout"])
    tokens_per_step = m["batch_size"] * m["seq_len"] * layout.dp_degree
    kw = dict(steps=cfg.steps, device=device, mesh=mesh, tokens_per_step=tokens_per_step, log=None)

    eager = EagerProgram(eager_config(m), layout, env.rank, batch_size=m["batch_size"], seq_len=m["seq_len"],
                         device=device, mesh=mesh, seed=cfg.seed, compute_dtype=getattr(torch, m["dtype"]))
    # The reference is torch's own AdamW (its single-tensor path, which titan's AdamW mirrors).
    eager_opt = torch.optim.AdamW(eager.params, lr=cfg.lr, foreach=False, **ADAMW)
    eager_losses = train_loop(eager.step, eager_opt,
                              make_data(m, cfg, layout.coordinates(env.rank)), **kw)
    del eager
    program = GraphProgram(art, env.rank, device=device, mesh=mesh, seed=cfg.seed)
    if program.fusion is not None and env.rank == 0:
        print(program.fusion.line(), flush=True)
    with step_function(program, cfg, device) as step:
        graph_losses = train_loop(step, make_optimizer(program.params, cfg.lr), make_data(m, cfg, program.coords), **kw)
    return eager_losses, graph_losses, device


def all_ranks_equal(eager: list[torch.Tensor], graph: list[torch.Tensor], device: torch.device) -> bool:
    """Bitwise equality of this rank's losses, agreed across ranks."""
    same = all(torch.equal(a, b) for a, b in zip(eager, graph))
    if not dist.is_initialized():
        return same
    flag = torch.tensor([0 if same else 1], device=device)
    dist.all_reduce(flag)
    return int(flag) == 0

"""Eager PyTorch reference: the same model code and parallelism, run op by op with DTensor.

titan-verify compares an artifact against this, step by step.
"""

from __future__ import annotations

import torch
from torch import nn

from titan.builder.models.spec import ModelConfig, ModelSpec, RankPlace
from titan.builder.trace.parallelize import ParamShard, parallelize
from titan.runtime.init import materialize
from titan.runtime.contract.layout import Layout


def materialize_shards(model: nn.Module, shards: list[ParamShard], specs: dict[str, dict], *, seed: int,
                       device: torch.device) -> None:
    """Replace each (meta) parameter shard of a parallelized model with its values for `seed`
    (`specs`: the model's init specs), drawn exactly as the runtime draws them, and each buffer
    with zeros."""
    by_fqn = {s.fqn: s for s in shards}
    for mod_name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            local = materialize(by_fqn[fqn].spec(specs[fqn]), seed=seed, device=device)
            module._parameters[pname] = nn.Parameter(local)
        for bname, buf in list(module._buffers.items()):
            if buf is not None:  # buffers start at zero, as the runtime's (runtime/buffer_state.py)
                module._buffers[bname] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)


class EagerProgram:
    def __init__(self, spec: ModelSpec, cfg: ModelConfig, layout: Layout, rank: int, *, batch_size: int,
                 seq_len: int, device: torch.device, mesh, seed: int, compute_dtype: torch.dtype = torch.float32):
        with torch.device("meta"):
            model = spec.build(cfg)
        model.loss_scale = float(batch_size * seq_len * layout.dp_degree)
        shards = parallelize(model, layout, mesh, layout.coordinates(rank), tp_plan=spec.tp_plan,
                             expert_param=spec.expert_param, compute_dtype=compute_dtype)
        spec.place_rank(model, RankPlace(layout=layout, mesh=mesh, batch_size=batch_size, seq_len=seq_len))
        materialize_shards(model, shards, spec.init_specs(cfg), seed=seed, device=device)
        self.model = model
        self.params = list(model.parameters())

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model(tokens, labels)
        loss.backward()
        return loss.detach()

"""Eager PyTorch reference: the same model code and parallelism, run op by op with DTensor.

titan-verify compares an artifact against this, step by step.
"""

from __future__ import annotations

import torch
from torch import nn

from titan.builder.layout import Layout
from titan.builder.models.llama3 import Llama3, init_specs
from titan.builder.models.llama3_config import LlamaConfig
from titan.builder.parallelize import parallelize
from titan.runtime.init import materialize


class EagerProgram:
    def __init__(self, cfg: LlamaConfig, layout: Layout, rank: int, *, batch_size: int, seq_len: int,
                 device: torch.device, mesh, seed: int, compute_dtype: torch.dtype = torch.float32):
        with torch.device("meta"):
            model = Llama3(cfg)
        model.loss_scale = float(batch_size * seq_len * layout.dp_degree)
        shards = {s.fqn: s for s in parallelize(model, layout, mesh, layout.coordinates(rank),
                                                compute_dtype=compute_dtype)}
        specs = init_specs(cfg)
        for mod_name, module in model.named_modules():
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                s = shards[fqn]
                local = materialize({"fqn": fqn, "global_shape": list(s.global_shape),
                                     "local_shape": list(s.local_shape), "slices": [list(x) for x in s.slices],
                                     "init": specs[fqn]}, seed=seed, device=device)
                module._parameters[pname] = nn.Parameter(local)
        self.model = model
        self.params = list(model.parameters())

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model(tokens, labels)
        loss.backward()
        return loss.detach()

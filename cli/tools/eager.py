"""Eager PyTorch reference: the same model code and parallelism, run op by op with DTensor,
trained with PyTorch's own recipe pieces (autograd's gradient accumulation, clip_grad_norm_ on
DTensors; torch.optim.AdamW and LambdaLR in cli/tools/verify.py).

titan-verify compares an artifact against this, step by step.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

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
                 seq_len: int, device: torch.device, mesh, seed: int, compute_dtype: torch.dtype = torch.float32,
                 micro_batches: int = 1, capacity_factor: float | None = None):
        """`capacity_factor`: a MoE dispatch that drops past this capacity (the reference of a
        drop-and-pad artifact); None: dropless, the reference of every other artifact."""
        with torch.device("meta"):
            model = spec.build(cfg)
        model.loss_scale = float(batch_size * seq_len * layout.dp_degree)
        shards = parallelize(model, layout, mesh, layout.coordinates(rank), tp_plan=spec.tp_plan,
                             expert_param=spec.expert_param, compute_dtype=compute_dtype)
        spec.place_rank(model, RankPlace(layout=layout, mesh=mesh, batch_size=batch_size, seq_len=seq_len,
                                         capacity_factor=capacity_factor))
        materialize_shards(model, shards, spec.init_specs(cfg), seed=seed, device=device)
        self.model = model
        self.params = list(model.parameters())
        placements = {s.fqn: s.placements for s in shards}
        self.placements = [placements[fqn] for fqn, _ in model.named_parameters()]
        self.mesh = mesh
        self.micro_batches = micro_batches

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch: autograd adds its gradients to .grad."""
        loss = self.model(tokens, labels)
        if self.micro_batches > 1:
            loss = loss / self.micro_batches
        loss.backward()
        return loss.detach()

    @torch.no_grad()
    def forward_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of a held-out batch; the buffers the forward updates (a MoE's load and
        balancing bias) are put back, so training goes on as if it had not run."""
        buffers = {name: b.clone() for name, b in self.model.named_buffers()}
        with warnings.catch_warnings():  # SimpleFSDP's redistribute under no_grad: DTensor's advice is for autograd
            warnings.filterwarnings("ignore", message="To construct DTensor from torch.Tensor")
            loss = self.model(tokens, labels)
        for name, b in self.model.named_buffers():
            b.copy_(buffers[name])
        return loss

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the model's gradients as DTensors on the job's
        mesh (each parameter's placements: FSDP, tensor-parallel and expert shards, replicated
        elsewhere), as a DTensor model would hold them; the global norm, as a local tensor.
        Without `max_norm`, only the norm (torch.nn.utils.get_total_norm)."""
        if self.mesh is None:
            grads, params = [p.grad for p in self.params], self.params
        else:
            params = []
            for p, placements in zip(self.params, self.placements):
                wrapped = [_placement(placements.get(dim, "R")) for dim in self.mesh.mesh_dim_names]
                param = DTensor.from_local(p.detach(), self.mesh, wrapped, run_check=False)
                param.grad = DTensor.from_local(p.grad, self.mesh, wrapped, run_check=False)
                params.append(param)
            grads = [p.grad for p in params]
        # DTensor warns that its two sequential all-reduces (2-D meshes) are suboptimal: they are the reference.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.to_local() if isinstance(norm, DTensor) else norm


def _placement(text: str):
    return Shard(int(text[2:-1])) if text.startswith("S(") else Replicate()

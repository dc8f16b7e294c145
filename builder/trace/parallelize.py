"""Apply a Layout to a model: tensor parallelism (with sequence parallel) and
SimpleFSDP-style data parallelism.

Every parameter leaf ends up as a plain local tensor: this rank's shard. A class-level
property re-wraps it on access: `DTensor.from_local` on the data-parallel mesh, a
redistribute to Replicate (the FSDP all-gather), `to_local` with Partial gradients (so the
backward reduce-scatters / all-reduces), and `DTensor.from_local` on the tp mesh for the
tensor-parallel modules. All collectives of the step, forward and backward, are therefore
inside the traced graph and every gradient comes out fully reduced, in the same layout as
its parameter: nothing is owed after the graph. The eager reference runs this same module.

A parameter that two modules share (tied input and output embeddings) stays one parameter:
one local shard, held by the first module, and one accessor per module, each with that
module's tensor-parallel view of it; autograd sums the two uses' gradients.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from titan.runtime.contract.shard_tensors import shard_of
from titan.runtime.contract.layout import DP_DIMS, Layout
from titan.runtime.contract.rank_record import ParamShard


def _placement_str(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    assert isinstance(p, Replicate), f"unexpected parameter placement {p}"
    return "R"


class _ShardedParamAccess:
    """Computes the tensor a module sees for one of its sharded parameters.

    Mixed precision as FSDP2's MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32):
    the fp32 shard is cast to the compute dtype before the all-gather, and its gradient is
    reduced (reduce-scatter / all-reduce over data parallel) in fp32. Tensor-parallel
    reductions run in the compute dtype, like the activations they come from.

    Shards of dim-0 size `rows` that dp_shard does not divide are padded chunks, as in FSDP2:
    the all-gather moves equal chunks, and the gathered tensor is cut back to `rows`. The cut
    is the same on every rank (the graph stays rank-agnostic).
    """

    def __init__(self, *, dp_mesh: DeviceMesh | None, dp_placements: tuple, rows: int, tp_mesh: DeviceMesh | None,
                 tp_placements: tuple, tp_plain: bool = False, compute_dtype: torch.dtype):
        self.dp_mesh = dp_mesh
        self.dp_placements = dp_placements
        self.rows = rows
        self.tp_mesh = tp_mesh
        self.tp_placements = tp_placements
        self.tp_plain = tp_plain
        self.compute_dtype = compute_dtype

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        x = local
        if self.dp_mesh is not None:
            n = len(self.dp_placements)
            sharded = DTensor.from_local(x, self.dp_mesh, self.dp_placements, run_check=False)
            cast = self.compute_dtype if self.compute_dtype != x.dtype else None
            full = sharded.redistribute(self.dp_mesh, (Replicate(),) * n, forward_dtype=cast,
                                        backward_dtype=x.dtype if cast else None)
            x = full.to_local(grad_placements=(Partial(),) * n)
            if x.shape[0] != self.rows:
                # Uneven FSDP shards were padded to equal chunks: drop the padding rows. Their
                # gradient is zero (narrow's backward), so reduce-scatter keeps the padding zero.
                x = x.narrow(0, 0, self.rows)
        elif x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.tp_mesh is not None:
            x = DTensor.from_local(x, self.tp_mesh, self.tp_placements, run_check=False)
            if self.tp_plain:
                # Identity forward, all-reduce of the gradient over tp (this rank's tokens' share).
                x = x.to_local(grad_placements=(Partial(),))
        return x


def _install_access(module: nn.Module, name: str, access: _ShardedParamAccess,
                    owner: tuple[nn.Module, str] | None = None) -> None:
    """Make `module.<name>` return access(local shard); the shard stays in _parameters (of
    `owner`, (module, name), for a parameter tied to another module's)."""
    cls = module.__class__
    accessors = dict(getattr(cls, "_titan_accessors", {}))
    accessors[name] = access
    if not getattr(cls, "_titan_sharded", False):
        cls = type(cls.__name__, (cls,), {"_titan_sharded": True})
        module.__class__ = cls
    cls._titan_accessors = accessors
    if owner is None:
        setattr(cls, name, property(lambda self, _n=name: self.__class__._titan_accessors[_n](self._parameters[_n])))
    else:
        holder, held = owner
        setattr(cls, name, property(lambda self, _n=name: self.__class__._titan_accessors[_n](holder._parameters[held])))


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the name of the parameter it is (tied weights: the same tensor held by
    two modules), for each name after the first of a shared parameter."""
    first: dict[int, str] = {}
    ties = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[fqn] = first[id(param)]
        else:
            first[id(param)] = fqn
    return ties


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh | None, coords: dict[str, int], *,
                tp_plan: Callable[[nn.Module], dict], expert_param: Callable[[str], bool] | None = None,
                compute_dtype: torch.dtype = torch.float32) -> list[ParamShard]:
    """Shard `model` in place for this rank; return where each local shard sits. Parameters
    stay fp32 (master weights); modules compute in `compute_dtype`. `tp_plan(model)` is the
    model's tensor-parallel plan (its spec's); `expert_param(fqn)` says which parameters are
    routed experts, sliced on dim 0 over the `ep` dimension (every other parameter is data
    parallel over `ep` as over the other data-parallel dimensions).

    Works on a meta model (for tracing) and on a real one (for the eager reference).
    """
    names = mesh.mesh_dim_names if mesh is not None else ()
    tp_mesh = mesh["tp"] if "tp" in names else None
    dp_names = tuple(n for n in DP_DIMS if n in names)
    # Routed experts are split over ep, so they are data parallel over the other dimensions only.
    expert_dp_names = tuple(n for n in dp_names if n != "ep")
    dp_meshes = {dims: mesh[dims] if dims else None for dims in {dp_names, expert_dp_names}}
    ties = tied_parameters(model)
    if mesh is None and compute_dtype == torch.float32 and not ties:
        return [ParamShard(fqn=fqn, global_shape=tuple(p.shape), local_shape=tuple(p.shape),
                           placements={}, slices=()) for fqn, p in model.named_parameters()]
    if tp_mesh is not None:
        parallelize_module(model, tp_mesh, tp_plan(model))

    shards = []
    owners: dict[str, tuple[nn.Module, str, ParamShard]] = {}
    for mod_name, module in list(model.named_modules()):
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            placements: dict[str, str] = {}
            slices: list[tuple[int, int, int]] = []
            is_expert = expert_param is not None and expert_param(fqn)
            param_dp_names = expert_dp_names if is_expert else dp_names
            if isinstance(param, DTensor):
                global_shape = tuple(param.shape)
                tp_placements = tuple(param.placements)
                (tp_pl,) = tp_placements
                placements["tp"] = _placement_str(tp_pl)
                if isinstance(tp_pl, Shard):
                    slices.append((tp_pl.dim, layout.tp, coords["tp"]))
                local = param.to_local()
            else:
                global_shape = tuple(param.shape)
                # A parameter the tp plan leaves plain sees only this rank's tokens (the
                # sequence shard): replicated over tp, its gradient is summed over tp.
                tp_placements = (Replicate(),) if tp_mesh is not None else ()
                local = param.data
            if is_expert and "ep" in names:
                placements["ep"] = "S(0)"
                slices.append((0, layout.ep, coords["ep"]))
                local = shard_of(local.detach(), [[0, layout.ep, coords["ep"]]])
            dp_placements = []
            for dp_name in param_dp_names:
                if dp_name == "dp_shard":
                    dp_placements.append(Shard(0))
                    placements[dp_name] = "S(0)"
                    slices.append((0, layout.dp_shard, coords["dp_shard"]))
                else:
                    dp_placements.append(Replicate())
                    placements[dp_name] = "R"
            rows = local.shape[0]
            if "dp_shard" in dp_names:
                # torch.chunk's cut, zero-padded to a full chunk where it does not divide (FSDP2).
                local = shard_of(local.detach(), [[0, layout.dp_shard, coords["dp_shard"]]])
            access = _ShardedParamAccess(
                dp_mesh=dp_meshes[param_dp_names], dp_placements=tuple(dp_placements), rows=rows,
                tp_mesh=tp_mesh if tp_placements else None, tp_placements=tp_placements,
                tp_plain=not isinstance(param, DTensor), compute_dtype=compute_dtype)
            shard = ParamShard(fqn=fqn, global_shape=global_shape, local_shape=tuple(local.shape),
                               placements={n: placements.get(n, "R") for n in names}, slices=tuple(slices))
            if fqn in ties:
                holder, held, owned = owners[ties[fqn]]
                if (owned.global_shape, owned.slices) != (shard.global_shape, shard.slices):
                    raise ValueError(f"{fqn} is tied to {ties[fqn]}, but this layout splits them differently "
                                     f"({shard.placements} against {owned.placements}), so they cannot stay one "
                                     "parameter; use a flavor without tied weights or another layout")
                del module._parameters[pname]  # read through the owner's shard
                _install_access(module, pname, access, owner=(holder, held))
                continue
            module._parameters[pname] = nn.Parameter(local.detach().clone() if local.device.type != "meta"
                                                     else torch.empty_like(local), requires_grad=True)
            _install_access(module, pname, access)
            owners[fqn] = (module, pname, shard)
            shards.append(shard)
    return shards

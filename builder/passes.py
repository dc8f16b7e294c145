"""Graph passes: each `name_pass(gm, *, ctx) -> gm` does one job, is chosen by name from
PASSES (`titan-build --passes`), and is recorded in the artifact's pass list (and so in the
cache key). Passes run on the forward and on the backward graph, after partitioning.

This module imports torch only inside the passes: the registry is read on the cache-hit path.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.fx as fx


@dataclass(kw_only=True, slots=True)
class PassContext:
    graph: str
    """'forward' or 'backward'."""
    mesh_dims: dict[str, str]
    """Process-group name -> mesh dimension ('tp', 'dp_shard', 'dp_replicate')."""
    input_names: list[str | None]
    """Per graph input: the parameter it holds, else None."""
    output_names: list[str | None]
    """Per graph output: the parameter whose gradient it is, else None."""
    plan: list[dict] = field(default_factory=list)
    """Bucket records the passes add (the rank's bucket plan)."""


def mask_index_put_to_where_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """index_put(x, [bool_mask], scalar) -> where(mask, scalar, x).

    The vocab-parallel embedding masks out-of-shard ids this way. A boolean-mask index_put
    runs nonzero() first, a device-to-host sync that a CUDA graph cannot capture; where() is
    the same selection with no sync, and writes the same bits.
    """
    import torch

    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.target is not aten.index_put.default:
            continue
        x, indices, values = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if accumulate or len(indices) != 1 or indices[0] is None:
            continue
        mask = indices[0]
        mask_val, x_val, v_val = mask.meta["val"], x.meta["val"], values.meta["val"]
        if mask_val.dtype != torch.bool or v_val.dim() != 0 or v_val.dtype != x_val.dtype:
            continue
        if tuple(mask_val.shape) != tuple(x_val.shape[:mask_val.dim()]):
            continue
        with gm.graph.inserting_before(node):
            cond = mask
            extra = x_val.dim() - mask_val.dim()
            if extra:
                shape = list(mask_val.shape) + [1] * extra
                cond = gm.graph.call_function(aten.view.default, (mask, shape))
                cond.meta = dict(mask.meta, val=mask_val.view(shape))
            where = gm.graph.call_function(aten.where.self, (cond, values, x))
            where.meta = dict(node.meta)
        node.replace_all_uses_with(where)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class GraphPass:
    target: str
    """'module:function' of the pass (imported when the pass runs)."""
    preserves_numerics: bool
    """False for passes whose results may differ from eager (opt-in, labeled)."""
    summary: str
    """One line for --list-passes."""
    needs: tuple[str, ...] = ()
    """Mesh dimensions the layout must have (size > 1) for the pass to apply."""

    @property
    def fn(self) -> Callable[..., fx.GraphModule]:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


PASSES: dict[str, GraphPass] = {
    "mask_index_put_to_where": GraphPass(
        "titan.builder.passes:mask_index_put_to_where_pass", True,
        "boolean-mask index_put -> where: same bits, no host sync (lets CUDA graphs capture the "
        "vocab-parallel embedding)"),
    "bucket_all_gather": GraphPass(
        "titan.builder.bucketing:bucket_all_gather_pass", True,
        "one FSDP all-gather per transformer block on a flat buffer (copies only: same bits)",
        needs=("dp_shard",)),
    "bucket_reduce_scatter": GraphPass(
        "titan.builder.bucketing:bucket_reduce_scatter_pass", True,
        "one FSDP gradient reduce-scatter per transformer block on a flat buffer (each element "
        "summed over the same ranks)", needs=("dp_shard",)),
    "overlap_collectives": GraphPass(
        "titan.builder.overlap:overlap_collectives_pass", True,
        "reorder only: issue collectives early (FSDP all-gathers one block ahead), wait late "
        "(reduce-scatters behind the next block's backward)"),
    "fuse_exact": GraphPass(
        "titan.builder.regions:fuse_exact_pass", True,
        "inductor-lite codegen: chains of element-wise ops measured bit-exact become kernels that "
        "titan-run generates on its GPU; reductions and all else stay on eager kernels (CPU runs "
        "keep eager kernels throughout)"),
    "fuse_regions": GraphPass(
        "titan.builder.regions:fuse_regions_pass", False,
        "titan-build --fuse regions: RMSNorm, RoPE, SwiGLU and the loss become kernels that titan-run "
        "generates on its device (last-bit differences from eager)"),
    "fuse_blocks": GraphPass(
        "titan.builder.regions:fuse_blocks_pass", False,
        "titan-build --fuse (blocks): like fuse_regions, but a region spans all element-wise and "
        "reduction work between a block's matmuls, attention and collectives (residual adds join the "
        "norms after them)"),
}


# Activation checkpointing policies (titan-build --ac; applied by builder/checkpointing.py).
AC_POLICIES = ("none", "full", "selective")


def default_passes(mesh_sizes: dict[str, int]) -> tuple[str, ...]:
    """The numerics-preserving set that applies to a layout, in order."""
    fsdp = mesh_sizes.get("dp_shard", 1) > 1
    return ("mask_index_put_to_where",
            *(("bucket_all_gather", "bucket_reduce_scatter") if fsdp else ()),
            "overlap_collectives", "fuse_exact")


FUSION_PASSES = ("fuse_exact", "fuse_regions", "fuse_blocks")


def check_passes(names: tuple[str, ...], mesh_sizes: dict[str, int]) -> None:
    """Refuse unknown, repeated, or inapplicable passes (a pass never silently skips)."""
    for name in names:
        if name not in PASSES:
            raise ValueError(f"unknown pass {name!r}; titan-build --list-passes shows them")
        for dim in PASSES[name].needs:
            if mesh_sizes.get(dim, 1) < 2:
                raise ValueError(f"pass {name} needs --{dim.replace('_', '-')} > 1 in the layout; "
                                 "drop it from --passes")
    if len(set(names)) != len(names):
        raise ValueError(f"--passes lists a pass twice: {', '.join(names)}")
    fusions = [n for n in names if n in FUSION_PASSES]
    if len(fusions) > 1:
        raise ValueError(f"--passes lists {' and '.join(fusions)}: each tags all fusion regions; keep one")
    if fusions and names[-1] != fusions[0]:
        raise ValueError(f"--passes: {fusions[0]} must come last (it groups the graph's final order into kernels)")

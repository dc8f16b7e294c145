"""The registry of graph passes: each `name_pass(gm, *, ctx) -> gm` does one job, is chosen by
name from PASSES (`titan-build --passes`), and is recorded in the artifact's pass list (and so
in the cache key). Passes run on the forward and on the backward graph, after partitioning.

This module is only the registry and the passes' shared context; it imports no torch (the
registry is read on the cache-hit path). The passes themselves live in their own modules.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.fx as fx

    from titan.builder.models.spec import ModelSpec
    from titan.runtime.contract.rank_record import Bucket


@dataclass(kw_only=True, slots=True)
class PassContext:
    graph: str
    """'forward' or 'backward'."""
    model: ModelSpec
    """The model's spec (its block naming and fusion region kinds)."""
    mesh_dims: dict[str, str]
    """Process-group name -> mesh dimension ('tp', 'dp_shard', 'dp_replicate')."""
    input_names: list[str | None]
    """Per graph input: the parameter it holds, else None."""
    output_names: list[str | None]
    """Per graph output: the parameter whose gradient it is, else None."""
    plan: list[Bucket] = field(default_factory=list)
    """Bucket records the passes add (the rank's bucket plan)."""
    input_casts: dict[int, str] = field(default_factory=dict)
    """Forward input index -> the dtype the forward now takes that parameter in (its copy, kept
    by titan-run: fold_param_casts); the backward's context shares the forward's."""


@dataclass(kw_only=True, frozen=True)
class GraphPass:
    target: str
    """'module:function' of the pass (imported when the pass runs)."""
    preserves_numerics: bool
    """False for passes whose results may differ from eager (opt-in, labeled)."""
    summary: str
    """What it does, for --list-passes (prose: line breaks read as spaces; see `line`)."""
    needs: tuple[str, ...] = ()
    """Mesh dimensions the layout must have (size > 1) for the pass to apply."""
    not_with: tuple[str, ...] = ()
    """Mesh dimensions the layout must not have (size > 1) for the pass to apply."""

    @property
    def line(self) -> str:
        """The summary on one line."""
        return " ".join(self.summary.split())

    @property
    def fn(self) -> Callable[..., fx.GraphModule]:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


PASSES: dict[str, GraphPass] = {
    "mask_index_put_to_where": GraphPass(
        target="titan.builder.passes.embedding_mask:mask_index_put_to_where_pass", preserves_numerics=True,
        summary="""boolean-mask index_put -> where: same bits, no host sync (lets CUDA graphs
        capture the vocab-parallel embedding)"""),
    "bucket_all_gather": GraphPass(
        target="titan.builder.passes.bucketing:bucket_all_gather_pass", preserves_numerics=True,
        summary="""one FSDP all-gather per transformer block on a flat buffer (copies only: same
        bits)""", needs=("dp_shard",)),
    "bucket_reduce_scatter": GraphPass(
        target="titan.builder.passes.bucketing:bucket_reduce_scatter_pass", preserves_numerics=True,
        summary="""one FSDP gradient reduce-scatter per transformer block on a flat buffer (each
        element summed over the same ranks)""", needs=("dp_shard",)),
    "fold_param_casts": GraphPass(
        target="titan.builder.passes.param_casts:fold_param_casts_pass", preserves_numerics=True,
        summary="""the forward takes each parameter as its compute-dtype copy, which titan-run's
        optimizer step writes as it writes the parameter, and the backward returns the copy's
        gradient, which the update upcasts as it reads it (the same roundings: same bits; a
        pass over the parameters and one over the gradients fewer per step)""", not_with=("pp",)),
    "overlap_collectives": GraphPass(
        target="titan.builder.passes.overlap:overlap_collectives_pass", preserves_numerics=True,
        summary="""reorder only: issue collectives early (FSDP all-gathers one block ahead),
        wait late (reduce-scatters behind the next block's backward)"""),
    "fuse_exact": GraphPass(
        target="titan.builder.passes.regions:fuse_exact_pass", preserves_numerics=True,
        summary="""inductor-lite codegen: chains of element-wise ops measured bit-exact become
        kernels that titan-run generates on its GPU; reductions and all else stay on
        eager kernels (CPU runs keep eager kernels throughout)"""),
    "fuse_regions": GraphPass(
        target="titan.builder.passes.regions:fuse_regions_pass", preserves_numerics=False,
        summary="""titan-build --fuse regions: RMSNorm, RoPE, SwiGLU and the loss become kernels
        that titan-run generates on its device (last-bit differences from eager)"""),
    "fuse_blocks": GraphPass(
        target="titan.builder.passes.regions:fuse_blocks_pass", preserves_numerics=False,
        summary="""titan-build --fuse (blocks): like fuse_regions, but a region spans all
        element-wise and reduction work between a block's matmuls, attention and
        collectives (residual adds join the norms after them)"""),
}


def default_passes(mesh_sizes: dict[str, int], *, exact_fusion: bool = True) -> tuple[str, ...]:
    """The numerics-preserving set that applies to a layout, in order (fuse_exact only for a
    family whose regions were measured bitwise on a GPU: ModelSpec.exact_fusion)."""
    fsdp = mesh_sizes.get("dp_shard", 1) > 1
    return ("mask_index_put_to_where",
            *(("bucket_all_gather", "bucket_reduce_scatter") if fsdp else ()),
            *(("fold_param_casts",) if mesh_sizes.get("pp", 1) < 2 else ()),
            "overlap_collectives", *(("fuse_exact",) if exact_fusion else ()))


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
        for dim in PASSES[name].not_with:
            if mesh_sizes.get(dim, 1) > 1:
                raise ValueError(f"pass {name} does not apply with --{dim.replace('_', '-')} > 1; "
                                 "drop it from --passes")
    if len(set(names)) != len(names):
        raise ValueError(f"--passes lists a pass twice: {', '.join(names)}")
    fusions = [n for n in names if n in FUSION_PASSES]
    if len(fusions) > 1:
        raise ValueError(f"--passes lists {' and '.join(fusions)}: each tags all fusion regions; keep one")
    if fusions and names[-1] != fusions[0]:
        raise ValueError(f"--passes: {fusions[0]} must come last (it groups the graph's final order into kernels)")

"""Gradient clipping by global norm, on the device, bit for bit what
`torch.nn.utils.clip_grad_norm_` computes for the same gradients as DTensors.

The norm is over every parameter of the model: each rank holds shards (FSDP, tensor-parallel,
expert-parallel) and copies (data-parallel replicas, and every parameter a mesh dimension does
not shard). For DTensors on one mesh, clip_grad_norm_ does this (read from torch 2.13's DTensor
redistribution; torch 2.11 on the GPU host is not yet checked), and so does this module:

1. `torch._foreach_norm` of the local gradients (one fp32 scalar per parameter). A parameter
   sharded over a mesh dimension has a partial norm there (`_NormPartial(2)`); otherwise the
   norm is replicated over it.
2. `torch.stack` of the norms. Its output is partial over every mesh dimension where some norm
   is (turning a replicated value into a partial one needs no communication), so each norm
   replicated over such a dimension is first divided by `size ** (1/2)` there, dimension by
   dimension in mesh order: a copy is counted once, not once per rank.
3. `torch.linalg.vector_norm` of the stack, after its partial dimensions are reduced, in mesh
   order: `x ** 2`, an all-reduce (sum) over the dimension's group, `x ** 0.5`. A dimension
   that shards nothing (dp_replicate) is never reduced over: replicas are not counted twice.
4. The clip: `coef = clamp(max_norm / (norm + 1e-6), max=1.0)`, then `torch._foreach_mul_` of
   the gradients by that device tensor (or, on a GPU, the one-kernel AdamW multiplies each
   gradient by it as it reads it: the same rounding, one pass fewer). No value goes to the host.

A copy's bf16 gradient (runtime/param_copies.py: a captured step leaves it for the update, its
fp32 parameter's gradient being its exact upcast) is normed as it is, in fp32
(`_foreach_norm(..., dtype=float32)`: on a GPU the same kernel, chunks and float32 sums as over
the upcast tensor; elsewhere it is upcast first). Each tensor's norm does not depend on the
others in its list, so grouping the gradients by dtype changes no bit.

tests/test_recipe.py holds the equality against clip_grad_norm_ on DTensors for 1-D and 2-D
meshes with every placement mix, and titan-verify holds it for the models (DeepSeek-V3's
experts included: they are sharded over `ep`, the rest replicated over it).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

NORM_TYPE = 2.0


def _sharded_dims(placements: dict[str, str]) -> set[str]:
    return {dim for dim, placement in placements.items() if placement.startswith("S")}


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch._foreach_norm of fp32 gradients, each a float32 scalar, in order; a copy's gradient
    (bf16 or fp16) is normed as its upcast would be."""
    assert {g.dtype for g in grads} <= {torch.float32, torch.bfloat16, torch.float16}, \
        "float32 gradients (of float32 parameters, as clip_grad_norm_ sees them) or their copies'"
    norms: list[torch.Tensor | None] = [None] * len(grads)
    for dtype in dict.fromkeys(g.dtype for g in grads):
        where = [i for i, g in enumerate(grads) if g.dtype == dtype]
        group = [grads[i] for i in where]
        if dtype == torch.float32:
            found = torch._foreach_norm(group, NORM_TYPE)
        elif group[0].device.type == "cuda":
            found = torch._foreach_norm(group, NORM_TYPE, dtype=torch.float32)
        else:  # the CPU's norm kernels sum a bf16 tensor in another order: norm the upcast
            found = torch._foreach_norm([g.float() for g in group], NORM_TYPE)
        for i, norm in zip(where, found):
            norms[i] = norm
    return norms


class GlobalNormClip:
    """Computes the global gradient norm of this rank's parameters (and clips to `max_norm`
    when given). `placements`: each parameter's {mesh dim: "S(d)" | "R"}; `mesh`: the job's
    device mesh (None for one rank)."""

    def __init__(self, placements: list[dict[str, str]], mesh, *, max_norm: float | None, pipeline_group=None):
        """`pipeline_group`: with pipeline stages, the group of this rank's pipeline (its pp
        peers), whose stages hold the rest of the model."""
        self.max_norm = max_norm
        self.pipeline_group = pipeline_group
        dims = list(mesh.mesh_dim_names) if mesh is not None else []
        sharded = [_sharded_dims(p) for p in placements]
        partial = [d for d in dims if any(d in s for s in sharded)]
        sizes = {d: mesh.size(i) for i, d in enumerate(dims)}
        # Step 2: the divisors of each norm, in mesh order (math.pow as DTensor computes them).
        self.divisors = [[math.pow(sizes[d], 1 / NORM_TYPE) for d in partial if d not in s] for s in sharded]
        self.groups = [mesh.get_group(d) for d in partial]

    @torch.no_grad()
    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global norm (a device scalar, the same on every rank); scales `grads` in place
        when clipping."""
        total, coef = self.norm_and_coef(grads)
        if coef is not None:
            torch._foreach_mul_(grads, coef)
        return total

    @torch.no_grad()
    def norm_and_coef(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The global norm and, when clipping, the coefficient the gradients are to be multiplied
        by (both device scalars); the gradients are left as they are, for a caller that folds
        the multiplication into its next pass over them (runtime/captured_update.py)."""
        norms = _norms(grads)
        for i, divisors in enumerate(self.divisors):
            for d in divisors:
                norms[i] = norms[i] / d
        stacked = torch.stack(norms)
        for group in self.groups:
            stacked = stacked ** NORM_TYPE
            dist.all_reduce(stacked, group=group)
            stacked = stacked ** (1.0 / NORM_TYPE)
        total = torch.linalg.vector_norm(stacked, NORM_TYPE)
        if self.pipeline_group is not None:
            # The stages hold disjoint parameters: the model's norm sums their squares, as
            # torchtitan's clip_grad_norm_ does with pipeline parallelism after the DTensor norm.
            total = total ** NORM_TYPE
            dist.all_reduce(total, group=self.pipeline_group)
            total = total ** (1.0 / NORM_TYPE)
        if self.max_norm is None:
            return total, None
        return total, torch.clamp(self.max_norm / (total + 1e-6), max=1.0)

"""The parallel layout, defined once for the builder and the runtime: the mesh dimensions and
their sizes, a rank's coordinates on them and its data-parallel rank, the device mesh, and the
process-group name of each dimension (both ways: graphs name groups by dimension).

It lives on the runtime's side because the runtime must not import the builder. Imports no
torch at module level (titan-build's cache-hit path uses it).
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "tp")
"""Outermost first, as torchtitan orders them (pipeline stages outermost: stage-to-stage traffic
is the lightest); a rank's coordinates are row-major, tp innermost."""
DP_DIMS = ("dp_replicate", "dp_shard", "ep")
"""The data-parallel dimensions: each coordinate on them reads its own slice of the batch (the
expert-parallel ranks are carved from the data-parallel ones: they route their own tokens)."""


@dataclass(kw_only=True, frozen=True)
class Layout:
    pp: int = 1
    """Pipeline-parallel degree: the model's layers split into this many stages, one per coordinate
    (runtime/contract/pipeline_schedule.py)."""
    dp_replicate: int = 1
    """Plain data-parallel replicas (with dp_shard > 1: HSDP)."""
    dp_shard: int = 1
    """FSDP degree: parameters sharded on dim 0, all-gathered in forward."""
    ep: int = 1
    """Expert-parallel degree: the model's routed experts are split over these ranks, which are
    data parallel for every other parameter (a model without experts is built with ep 1)."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel)."""

    @staticmethod
    def from_dict(sizes: dict[str, int]) -> Layout:
        """From a manifest's `layout` ({dimension: size}); one written before `pp` existed has none."""
        return Layout(**{name: sizes.get(name, 1) if name == "pp" else sizes[name] for name in MESH_DIMS})

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.ep * self.tp

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: how many slices of the global batch a step reads."""
        return self.dp_replicate * self.dp_shard * self.ep

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """The mesh dimensions of size > 1, outermost first."""
        return tuple((name, getattr(self, name)) for name in MESH_DIMS if getattr(self, name) > 1)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each mesh dimension (row-major, tp innermost). Without a
        pipeline there is no `pp` coordinate: the rank records (and the trace cache keys made of
        them) of every build without --pp stay what they were before pp existed."""
        coords = {}
        for name in reversed(MESH_DIMS):
            coords[name] = rank % getattr(self, name)
            rank //= getattr(self, name)
        return {name: coords[name] for name in MESH_DIMS if name != "pp" or self.pp > 1}

    def dp_rank(self, coords: dict[str, int]) -> int:
        """Which slice of the global batch the rank at `coords` reads."""
        return ((coords.get("dp_replicate", 0) * self.dp_shard + coords.get("dp_shard", 0)) * self.ep
                + coords.get("ep", 0))

    def pipeline_peer(self, rank: int, pp_coord: int) -> int:
        """The rank at pipeline coordinate `pp_coord` whose other coordinates are `rank`'s: where
        `rank`'s stage sends activations and gradients (pp outermost: a block of ranks per stage)."""
        per_stage = self.world_size // self.pp
        return pp_coord * per_stage + rank % per_stage

    def tag(self) -> str:
        """'tp2', 'dp-shard2-tp2', ... ('single' for one rank): artifact names."""
        parts = [f"{name.replace('_', '-')}{size}" for name, size in self.mesh_shape()]
        return "-".join(parts) or "single"

    def build_mesh(self, device_type: str):
        """The device mesh of the dimensions of size > 1 (on the initialized process group), or
        None for a single rank."""
        dims = self.mesh_shape()
        if not dims:
            return None
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def group_names(mesh) -> dict[str, str]:
    """Mesh dimension -> this process's process-group name for it ({} without a mesh)."""
    if mesh is None:
        return {}
    return {name: mesh.get_group(name).group_name for name in mesh.mesh_dim_names}


def mesh_dims_by_group(mesh) -> dict[str, str]:
    """Process-group name -> mesh dimension: the inverse of group_names (graphs are written with
    dimension names, so that they do not depend on the order groups were created in)."""
    return {group: dim for dim, group in group_names(mesh).items()}

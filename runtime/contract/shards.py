"""Where a rank's shard of a parameter lies in the global tensor, from the artifact's `slices`.

A shard is cut by (dim, parts, index) steps applied in order, each with torch.chunk's rule as
FSDP2 applies it: the cut dim is split into chunks of ceil(size / parts) rows, so trailing
parts hold fewer rows, or none. Every rank keeps a full chunk (the padded local tensor): the
rows it really holds come first, zeros pad the rest, and collectives see equal sizes on every
rank. When every cut divides its dim, nothing is padded.

No torch import: the artifact checks (runtime/contract/checks.py) use this too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class ShardBox:
    offsets: tuple[int, ...]
    """Where the real rows of the shard start in the global tensor, per dim."""
    sizes: tuple[int, ...]
    """How many real rows the shard holds, per dim (0 where a trailing part got none)."""
    local_shape: tuple[int, ...]
    """The local tensor's shape: `sizes` padded to full chunks."""

    @property
    def padded(self) -> bool:
        return self.sizes != self.local_shape

    @property
    def empty(self) -> bool:
        return 0 in self.sizes

    def global_index(self) -> tuple[slice, ...]:
        """The real rows' index in the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def local_index(self) -> tuple[slice, ...]:
        """The real rows' index in the (padded) local tensor: they come first."""
        return tuple(slice(0, s) for s in self.sizes)


def chunk_size(size: int, parts: int) -> int:
    """Rows per part when `size` rows are cut into `parts` (torch.chunk, FSDP2)."""
    return -(-size // parts)


def shard_box(slices: list[list[int]], global_shape: list[int]) -> ShardBox:
    """The box that the (dim, parts, index) cuts, applied in order, leave of the global tensor.
    Each cut splits the previous (padded) chunk of its dim; a part past the real rows is empty
    and sits at their end."""
    offsets, sizes, local = [0] * len(global_shape), list(global_shape), list(global_shape)
    for dim, parts, index in slices:
        chunk = chunk_size(local[dim], parts)
        start = min(index * chunk, sizes[dim])
        offsets[dim] += start
        sizes[dim] = min(chunk, sizes[dim] - start)
        local[dim] = chunk
    return ShardBox(offsets=tuple(offsets), sizes=tuple(sizes), local_shape=tuple(local))

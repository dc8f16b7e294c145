"""A rank's shard of a tensor, cut as the contract's `slices` say (runtime/contract/shards.py
holds the torch-free arithmetic): the one cut the builder's parallelized model, the runtime's
initial parameters and checkpoint reads all use."""

from __future__ import annotations

import torch

from titan.runtime.contract.shards import ShardBox, shard_box


def shard_of(full: torch.Tensor, slices: list[list[int]]) -> torch.Tensor:
    """This rank's local tensor of `full`: its box, padded with zeros to full chunks where a
    cut does not divide (runtime/contract/shards.py). A sliced shard is a copy, so that the full tensor
    can be freed."""
    if not slices:
        return full
    box = shard_box(slices, list(full.shape))
    return pad_shard(full[box.global_index()], box)


def pad_shard(real: torch.Tensor, box: ShardBox) -> torch.Tensor:
    """The local tensor holding `real` (the box's rows): a contiguous copy, zero-padded to the
    box's local shape."""
    if not box.padded:
        return real.clone(memory_format=torch.contiguous_format)
    local = torch.zeros(box.local_shape, dtype=real.dtype, device=real.device)
    local[box.local_index()] = real
    return local

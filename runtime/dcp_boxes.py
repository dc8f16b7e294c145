"""DCP planners that place each local tensor as a box (offsets, sizes) of its global tensor.

titan's shards are plain local tensors whose place in the global tensor follows from the
artifact's `slices` (runtime/contract/shards.py `shard_box`; padding rows are not part of the box). DCP's
own types for that (DTensor placements, ShardedTensor) cannot state "this box" directly: a tp
slice followed by an FSDP cut of it needs strided placements, and ShardedTensor insists that
one rank's view covers the tensor without overlap, while replicated parameters are held whole
by several ranks. So the plans are made here from the boxes, with DCP's public plan types; DCP deduplicates equal boxes written by
several ranks and, on load, reads the intersection of each local box with the saved ones
(resharding across layouts).

Importing this module imports torch.distributed.checkpoint (the runtime does so only when a
run checkpoints or resumes).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

Box = tuple[list[int], list[int], list[int]]
"""(offsets, sizes, global_shape) of a local tensor."""


class BoxSavePlanner(DefaultSavePlanner):
    def __init__(self, boxes: dict[str, Box]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, tensor in self.state_dict.items():
            offsets, sizes, global_shape = self.boxes[fqn]
            assert list(tensor.shape) == sizes, (fqn, tensor.shape, sizes)
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                       sizes=torch.Size(sizes)),
                                            properties=TensorProperties.create_from_tensor(tensor),
                                            size=torch.Size(global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn]


class BoxLoadPlanner(DefaultLoadPlanner):
    def __init__(self, boxes: dict[str, Box], *, where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.where = boxes, where

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn in self.state_dict:
            offsets, sizes, global_shape = self.boxes[fqn]
            md = check_covered(self.metadata, fqn, global_shape, where=self.where)
            local = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items.extend(create_read_items_for_chunk_list(fqn, md, [local]))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def check_covered(metadata, fqn: str, global_shape: list[int], *, where: str):
    """The saved pieces of `fqn` make up a tensor of `global_shape` (pieces never overlap: DCP
    writes each box once); returns its storage metadata."""
    md = metadata.state_dict_metadata.get(fqn)
    if md is None:
        raise ValueError(f"{where} has no {fqn}; the checkpoint is incomplete (a shard file is missing) or of "
                         "another model")
    if list(md.size) != list(global_shape):
        raise ValueError(f"{where}: {fqn} has shape {list(md.size)}, not {list(global_shape)}; the checkpoint is "
                         "incomplete (a shard file is missing) or of another model")
    covered = sum(torch.Size(c.sizes).numel() for c in md.chunks)
    if covered != torch.Size(global_shape).numel():
        raise ValueError(f"{where}: the saved pieces of {fqn} do not cover it; the checkpoint is incomplete "
                         "(a shard file is missing)")
    return md

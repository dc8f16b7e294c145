"""The block mask FlexAttention's fused kernels read, built on the device from the document ids.

The fused kernels (runtime/kernels/flex_kernels.py) work on tiles of BLOCK x BLOCK queries and
keys. For each query tile they read which key tiles to visit: *full* tiles (every pair visible:
no mask is evaluated) and *partial* ones (the mask is evaluated per element, from the document
ids), in FlexAttention's BlockMask layout (torch.nn.attention.flex_attention: per row a count and
the column indices, visible ones first in ascending order; and the same for the transpose, which
the backward's key-tile loop reads). Tiles left out are skipped: nothing in them is visible.

Built from `documents` by a handful of ordinary ops on the device (a reduction per tile, a few
comparisons, a stable sort), with nothing read back to the host: a CUDA graph replays it with
each step's boundaries. The classification holds for any ids, sorted or not: a tile pair is
full only when every id in both tiles is one and the same and the keys all precede the queries,
and skipped only when the tiles' id ranges do not meet (or the keys all follow the queries).

No inductor here: the runtime builds the mask for every call.
"""

from __future__ import annotations

import torch

BLOCK = 128
"""Tile size, queries and keys (FlexAttention's default sparse block size)."""


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per row, column indices with the set ones first, ascending), int32: FlexAttention's
    `_dense_to_ordered`."""
    dense = dense.to(torch.int32)
    counts = dense.sum(dim=-1)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return counts.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous()


def block_mask_tensors(documents: torch.Tensor | None, *, batch: int, seq: int,
                       device: torch.device) -> tuple[torch.Tensor, ...]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
    full_q_num_blocks, full_q_indices): counts (batch, 1, tiles), indices (batch, 1, tiles, tiles),
    int32. `documents`: (batch, seq) int64, or None for the causal mask."""
    assert seq % BLOCK == 0, f"seq {seq} is not a multiple of the tile {BLOCK}"
    tiles = seq // BLOCK
    row = torch.arange(tiles, device=device)
    below = row[:, None] > row[None, :]      # key tile strictly before the query tile
    diagonal = row[:, None] == row[None, :]
    if documents is None:
        full = below.expand(batch, 1, tiles, tiles)
        partial = diagonal.expand(batch, 1, tiles, tiles)
    else:
        ids = documents.reshape(batch, tiles, BLOCK)
        low, high = ids.amin(dim=-1), ids.amax(dim=-1)                    # (batch, tiles)
        q_low, q_high = low[:, :, None], high[:, :, None]                 # query tile on rows
        k_low, k_high = low[:, None, :], high[:, None, :]                 # key tile on columns
        meet = (k_low <= q_high) & (q_low <= k_high)
        one_document = (q_low == q_high) & (k_low == k_high) & (q_low == k_low)
        full = (below & one_document)[:, None]
        partial = ((below & meet & ~one_document) | diagonal)[:, None]
    kv_num, kv_idx = _ordered(partial)
    full_kv_num, full_kv_idx = _ordered(full)
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    full_q_num, full_q_idx = _ordered(full.transpose(-2, -1))
    return kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx

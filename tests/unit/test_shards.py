"""Where a rank's shard lies (runtime/contract/shards.py): FSDP2's cut, padded where it does not divide,
at the sizes of the largest layouts, and the rows of a padded shard that a checkpoint holds."""

from __future__ import annotations

import pytest
import torch

from conftest import param_spec
from titan.runtime.contract.shards import chunk_size, shard_box


@pytest.mark.parametrize("slices", [[], [[0, 2, 1]], [[1, 2, 0], [0, 2, 1]], [[0, 2, 1], [0, 4, 3]], [[1, 4, 2], [0, 8, 7]],
                                    [[0, 3, 2]], [[1, 2, 1], [0, 5, 4]], [[0, 48, 31]], [[0, 48, 47]]])
def test_a_shard_is_the_box_its_slices_describe(slices):
    """FSDP2's cut: torch.chunk's rows for each part, zero-padded to a full chunk."""
    from titan.runtime.contract.shard_tensors import shard_of
    from titan.runtime.contract.shards import shard_box

    full = torch.arange(1, 64 * 32 + 1, dtype=torch.float32).view(64, 32)
    box = shard_box(slices, [64, 32])
    expected = full
    for dim, parts, index in slices:
        pieces = expected.chunk(parts, dim)
        expected = pieces[index] if index < len(pieces) else expected.narrow(dim, 0, 0)
    assert list(box.sizes) == list(expected.shape)
    assert torch.equal(full[box.offsets[0]:, box.offsets[1]:][:box.sizes[0], :box.sizes[1]], expected)
    local = shard_of(full, slices)
    assert list(local.shape) == list(box.local_shape)
    assert torch.equal(local[:box.sizes[0], :box.sizes[1]], expected)
    assert local.count_nonzero() == expected.numel(), "padding rows are zero"


def test_only_real_rows_of_padded_shards_are_checkpointed():
    """A padded shard saves and loads its real rows (a view of the live tensor); a trailing
    part with no real rows has nothing to checkpoint."""
    from titan.runtime.checkpoint import dcp_state
    from titan.runtime.recipe import Recipe
    from titan.runtime.train import make_optimizer

    params = [param_spec("a", [64, 32], [[0, 3, 2]]),    # rows 44..63 of a 22-row chunk
              param_spec("b", [64, 32], [[0, 48, 47]]),  # past the last row: empty
              param_spec("c", [64, 32], [[0, 2, 1]])]    # even: the whole tensor
    tensors = [torch.zeros(22, 32), torch.zeros(2, 32), torch.zeros(32, 32)]
    state, boxes = dcp_state(params, tensors, make_optimizer(tensors, Recipe.constant(0.0)))
    assert sorted(state) == sorted(f"{family}.{fqn}" for family in ("model", "optim.exp_avg", "optim.exp_avg_sq") for fqn in "ac")
    assert boxes["model.a"] == ([44, 0], [20, 32], [64, 32]) and boxes["model.c"] == ([32, 0], [32, 32], [64, 32])
    state["model.a"].fill_(1.0)  # what a load does to it
    assert tensors[0][:20].eq(1).all() and tensors[0][20:].eq(0).all()
    assert state["model.c"] is tensors[2]


def test_405b_at_tp8_dp_shard_128_is_a_valid_layout():
    """The embedding's 16,032 rows per tp shard do not divide by 128: FSDP pads, titan builds."""
    from titan.builder.spec.build_spec import make_spec
    from titan.runtime.contract.shards import shard_box

    spec = make_spec(model="llama3", flavor="405B", tp=8, dp_shard=128, dp_replicate=1, batch_size=None,
                     seq_len=None)
    assert spec.layout.world_size == 1024
    last = shard_box([[0, 8, 7], [0, 128, 127]], [128256, 16384])
    assert (last.offsets, last.sizes, last.local_shape) == ((128226, 0), (30, 16384), (126, 16384))


def test_chunk_size_is_torch_chunks_rows_per_part():
    for size in range(1, 40):
        for parts in range(1, 9):
            assert chunk_size(size, parts) == len(torch.arange(size).chunk(parts)[0]), (size, parts)


def test_a_box_says_where_its_real_rows_are_and_whether_it_is_padded():
    # 10 rows in 4 parts: chunks of 3; the last holds 1 real row and 2 rows of padding.
    last = shard_box([[0, 4, 3]], [10, 6])
    assert (last.offsets, last.sizes, last.local_shape) == ((9, 0), (1, 6), (3, 6))
    assert last.padded and not last.empty
    assert last.global_index() == (slice(9, 10), slice(0, 6)) and last.local_index() == (slice(0, 1), slice(0, 6))
    # 10 rows in 6 parts: chunks of 2; part 5 starts past the last row: no real rows, placed at their end.
    past = shard_box([[0, 6, 5]], [10, 6])
    assert (past.offsets, past.sizes, past.local_shape) == ((10, 0), (0, 6), (2, 6))
    assert past.empty and past.padded
    # A cut that divides pads nothing.
    even = shard_box([[1, 2, 1]], [10, 6])
    assert (even.offsets, even.sizes, even.local_shape) == ((0, 3), (10, 3), (10, 3))
    assert not even.padded and not even.empty

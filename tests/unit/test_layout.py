"""The one parallel layout (runtime/contract/layout.py) that builder and runtime share."""

from __future__ import annotations

import pytest

from titan.runtime.contract.layout import MESH_DIMS, Layout

_EIGHT_RANKS = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


@pytest.mark.parametrize("layout, dims, tag", [
    (Layout(dp_replicate=2, dp_shard=2, tp=2), ("dp_replicate", "dp_shard", "tp"), "dp-replicate2-dp-shard2-tp2"),
    # ep sits inside dp_shard and outside tp: a data-parallel dimension, reading its own slices.
    (Layout(dp_shard=2, ep=2, tp=2), ("dp_shard", "ep", "tp"), "dp-shard2-ep2-tp2"),
])
def test_ranks_are_row_major_over_the_mesh_with_tp_innermost(layout, dims, tag):
    coords = [layout.coordinates(r) for r in range(layout.world_size)]
    assert [tuple(c[d] for d in dims) for c in coords] == _EIGHT_RANKS
    # Ranks that differ only in tp read the same data; each data-parallel coordinate its own slice.
    assert [layout.dp_rank(c) for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.dp_degree == 4 and layout.tag() == tag


def test_the_mesh_and_the_name_list_only_dimensions_of_size_above_one():
    layout = Layout(dp_shard=4, tp=2)
    assert layout.mesh_shape() == (("dp_shard", 4), ("tp", 2))
    assert layout.tag() == "dp-shard4-tp2" and Layout().tag() == "single"
    assert Layout.from_dict(layout.as_dict()) == layout




@pytest.mark.parametrize("layout", [Layout(dp_replicate=2, dp_shard=3, ep=2, tp=4), Layout(tp=8), Layout(dp_shard=5),
                                    Layout(dp_replicate=3, ep=4), Layout()], ids=lambda layout: layout.tag())
def test_every_rank_has_its_own_place_and_each_batch_slice_one_tp_group(layout):
    coords = [layout.coordinates(r) for r in range(layout.world_size)]
    assert len({tuple(c.values()) for c in coords}) == layout.world_size
    assert all(0 <= c.get(d, 0) < getattr(layout, d) for c in coords for d in MESH_DIMS)
    assert not any("pp" in c for c in coords), "no pp coordinate without a pipeline (rank records stay as they were)"
    slices = [layout.dp_rank(c) for c in coords]
    assert sorted(set(slices)) == list(range(layout.dp_degree))
    # tp innermost: each run of tp consecutive ranks reads one slice, and no other rank reads it.
    groups = [slices[g:g + layout.tp] for g in range(0, layout.world_size, layout.tp)]
    assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == len(groups)
    assert Layout.from_dict(layout.as_dict()) == layout and layout.world_size == layout.dp_degree * layout.tp


@pytest.mark.parametrize("layout", [Layout(pp=2), Layout(pp=4, dp_shard=2, tp=2), Layout(pp=3, dp_replicate=2, ep=2)],
                         ids=lambda layout: layout.tag())
def test_a_pipeline_peer_differs_only_in_the_pp_coordinate(layout):
    for rank in range(layout.world_size):
        coords = layout.coordinates(rank)
        for p in range(layout.pp):
            peer = layout.coordinates(layout.pipeline_peer(rank, p))
            assert "pp" in coords and peer == coords | {"pp": p}
        assert layout.pipeline_peer(rank, coords["pp"]) == rank
    assert layout.dp_degree * layout.tp * layout.pp == layout.world_size

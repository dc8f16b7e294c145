"""A deep model's program is fitted from shallow traces (builder/program/stamp.py, deep_program.py) and
must be exactly the program that tracing every probe rank at full depth gives: every node,
every binding, the metadata (trace processes and a real build)."""

from __future__ import annotations

import pytest

import dataclasses

from titan.builder.build import build
from titan.builder.trace.cached import CachedTracer
from titan.builder.spec.build_spec import make_spec
from titan.runtime.store.build_cache import Cache
from titan.builder.spec.cache_key import build_factors
from titan.builder.program.bind import one_program, probe_ranks
from titan.builder.program.stamp import STAMP_CHECK_DEPTH, STAMP_DEPTHS
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.graph_doc import read_doc


@pytest.mark.slow
def test_a_program_fitted_from_shallow_traces_equals_the_full_depth_trace(tmp_path):
    """debug widths at 7 layers, tp 2 x dp-shard 2 (vocab-shard bindings, FSDP buckets): the
    build fits 3-5 layers and checks rank 0 at 6; each probe is also traced at all 7 here, in
    the same process as its shallow traces (one torch import per probe), before the build
    finds the shallow ones in the cache."""
    spec = dataclasses.replace(make_spec(model="llama3", flavor="debug", tp=2, dp_shard=2, dp_replicate=1,
                                         batch_size=None, seq_len=None), n_layers=7)
    cache = Cache(tmp_path / "cache")
    probes = probe_ranks(spec.layout)
    tracer = CachedTracer(spec, cache, build_factors(spec), 2, lambda rank, stage: None, lambda res: None)
    tracer.trace(probes, depths=lambda r: STAMP_DEPTHS + ((STAMP_CHECK_DEPTH,) if r == 0 else ()) + (None,))
    traced = one_program(spec.layout, [tracer.traces[r, None] for r in probes])
    assert traced.bindings > 0

    outcome = build(spec, tmp_path / "art", cache=cache, jobs=2)
    assert not outcome.hit and outcome.traced == [] and not outcome.note  # every shallow trace was cached
    art = open_artifact(tmp_path / "art")
    assert art.manifest.rank_programs == (0,) * 4 and art.manifest.model_config["n_layers"] == 7
    for kind in ("forward", "backward"):
        fitted = read_doc(art.read_verified(getattr(art.rank_entry(0), kind)))
        assert fitted == read_doc(getattr(traced, kind)), kind
    stored = art.program_json(0)
    assert {k: v for k, v in stored.items() if k not in ("forward_graph", "backward_graph")} == traced.meta.to_json()

"""The artifact contract (runtime/contract/): each record reads back exactly what titan-build
wrote, as typed values, and refuses what titan-build would not write, in one line."""

from __future__ import annotations

import json

import pytest

from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.checks import ArtifactError
from titan.runtime.contract.manifest import Manifest
from titan.runtime.contract.rank_record import Bucket, GraphInput, ParamSpec, RankRecord


@pytest.mark.slow
def test_manifest_and_rank_records_read_back_what_titan_build_wrote(debug_artifact):
    root = debug_artifact(tp=2, dp_shard=2)
    written = json.loads((root / "manifest.json").read_text())
    manifest = Manifest.from_json(written, root)
    assert manifest.to_json() == written and list(manifest.to_json()) == list(written)  # same keys, same order
    assert (manifest.layout.tp, manifest.layout.dp_shard, manifest.world_size) == (2, 2, 4)

    art = open_artifact(root)
    stored = json.loads(art.read_verified(manifest.programs[0].meta))
    record = art.rank_record(3)
    assert (record.rank, record.coords) == (3, {"dp_replicate": 0, "dp_shard": 1, "ep": 0, "tp": 1})
    assert all(isinstance(p, ParamSpec) for p in record.params)
    assert all(isinstance(i, GraphInput) for i in record.forward_inputs)
    assert record.bucket_plan and all(isinstance(b, Bucket) for b in record.bucket_plan)
    # Binding fills in the rank and each slice's index; everything else is the stored record.
    bound = record.to_json()
    assert {k: v for k, v in bound.items() if k not in ("rank", "coords", "params")} == \
        {k: v for k, v in stored.items() if k != "params"}
    assert [p["slices"] for p in stored["params"]][0] == [[0, 2, "tp"], [0, 2, "dp_shard"]]
    assert [p["slices"] for p in bound["params"]][0] == [[0, 2, 1], [0, 2, 1]]
    assert RankRecord.from_json(json.loads(json.dumps(bound)), "again") == record


@pytest.mark.parametrize("change, message", [
    (dict(world_size=3), "manifest: mesh [['dp_shard', 2], ['tp', 2]] does not multiply to world size 3"),
    (dict(passes="fuse_exact"), "manifest: 'passes' must list pass names"),
    (dict(layout={"dp_replicate": 1, "dp_shard": 2, "ep": 1, "tp": 1}), "manifest: 'layout' disagrees with 'mesh'"),
    (dict(format_version=1), "has artifact format 1; this runtime reads formats 2 to 4"),
])
def test_a_manifest_titan_build_would_not_write_is_refused_with_the_fix(debug_artifact, change, message):
    root = debug_artifact(tp=2, dp_shard=2)
    written = json.loads((root / "manifest.json").read_text())
    with pytest.raises(ArtifactError, match="rebuild") as e:
        Manifest.from_json(dict(written, **change), root)
    assert message in str(e.value) and "\n" not in str(e.value)

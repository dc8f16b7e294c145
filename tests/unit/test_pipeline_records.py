"""A pipeline artifact's records (runtime/contract/manifest.py's PipelinePlan, rank_record.py's
StageIO), written by hand as titan-build writes them: they read back what was written, give each
rank the programs of its own stages, and refuse what titan-build would not write in one line.
(Real pipeline builds: e2e/test_pipeline_artifacts.py.)"""

from __future__ import annotations

import json

import pytest

from titan.builder.spec.pipeline_order import pipeline_schedule
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.manifest import Manifest, PipelinePlan, ProgramFiles
from titan.runtime.contract.rank_record import StageIO

from test_contract_records import DROP, _edit, _manifest

SHAS = [c * 64 for c in "0123456789ab"]


def _program(i: int) -> ProgramFiles:
    return ProgramFiles(meta=f"programs/{SHAS[3 * i]}.json", forward=f"graphs/{SHAS[3 * i + 1]}.tgraph",
                        backward=f"graphs/{SHAS[3 * i + 2]}.tgraph")


def _pipeline_manifest(*, schedule: str = "interleaved-1f1b", layers: int = 4) -> Manifest:
    """pp 2 x tp 2: four one-layer stages, two per pp rank (interleaved), or two two-layer ones; one
    program per stage (each bound over tp)."""
    v = 2 if schedule == "interleaved-1f1b" else 1
    spans = [(i * layers // (2 * v), (i + 1) * layers // (2 * v)) for i in range(2 * v)]
    record = pipeline_schedule(schedule, spans=tuple(spans), microbatches=4, stages_per_rank=v)
    programs = tuple(_program(i) for i in range(2 * v))
    files = {getattr(p, k): getattr(p, k).split("/")[1].split(".")[0] for p in programs
             for k in ("meta", "forward", "backward")}
    plan = PipelinePlan(schedule=record, stage_programs=tuple((s, s) for s in range(2 * v)))
    return _manifest(layout=Layout(pp=2, tp=2), world_size=4, model_config={"vocab_size": 2048, "dim": 256,
                                                                            "n_layers": layers},
                     programs=programs, rank_programs=(0, 0, 1, 1), files=files, kernels={}, pipeline=plan)


def _json(manifest: Manifest) -> dict:
    return json.loads(json.dumps(manifest.to_json()))


def test_a_pipeline_manifest_reads_back_and_gives_each_rank_its_stages_programs():
    manifest = _pipeline_manifest()
    assert Manifest.from_json(_json(manifest), "art") == manifest
    # pp outermost: ranks 0 and 1 are pp rank 0 (stages 0 and 2), ranks 2 and 3 pp rank 1 (1 and 3).
    assert [manifest.stages_of(r) for r in range(4)] == [(0, 2), (0, 2), (1, 3), (1, 3)]
    assert manifest.program_of(3, 3) == manifest.programs[3] and manifest.program_of(1) == manifest.programs[0]
    assert manifest.microbatches == 4 and manifest.tokens_per_step == 2 * 128  # per micro-batch, no dp
    assert _manifest().stages_of(0) == () and _manifest().microbatches == 1


@pytest.mark.parametrize("path, value, message", [
    ("pipeline", None, "'pipeline' belongs with a pp mesh dimension, and a pp dimension needs it"),
    ("pipeline/stage_programs/1", [1], "'stage_programs' must give each of the 4 stages a program for each of its 2"),
    ("pipeline/stage_programs/1/0", 9, "stage_programs[1]: expected an integer in [0, 3], got 9"),
    ("rank_programs/2", 0, "rank 2's program in 'stage_programs' is not its first stage's (1)"),
    ("pipeline/schedule/actions/0/0", "0F9", "micro-batch out of range"),
    ("pipeline/schedule/stage_layers/3", [3, 5], "stage 3 stop: expected an integer in [0, 4], got 5"),
    ("pipeline/schedule/stage_rank/2", 1, "stage_rank [0, 1, 1, 1] is not interleaved-1f1b's placement"),
    ("model_config/n_layers", 5, "the stages hold 4 layers, the model has 5"),
    ("pipeline/extra", 1, "'pipeline' must hold exactly 'schedule' and 'stage_programs'"),
    ("pipeline/redo_stage_programs", [[0, 0], [1, 1], [2, 2], [3, 3]],
     "'pipeline' must hold exactly 'schedule' and 'stage_programs' (the redo programs exactly with a bounded"),
])
def test_a_pipeline_manifest_titan_build_would_not_write_is_refused_in_one_line(path, value, message):
    doc = _edit(_json(_pipeline_manifest()), path, value)
    with pytest.raises(ValueError, match="rebuild") as e:
        Manifest.from_json(doc, "art")
    assert message in str(e.value) and "\n" not in str(e.value)


def _redoing() -> dict:
    """The pipeline manifest with a bounded MoE dispatch that redoes overflows: each stage's
    dropless redo program beside its bounded one (here the same files)."""
    doc = _json(_pipeline_manifest())
    doc.update(format_version=3, moe_capacity={"factor": 1.25, "drop": False}, redo_programs=list(doc["programs"]),
               redo_rank_programs=list(doc["rank_programs"]))
    doc["pipeline"]["redo_stage_programs"] = [list(p) for p in doc["pipeline"]["stage_programs"]]
    return doc


def test_a_pipeline_with_redo_programs_gives_each_rank_its_stages_redo_programs():
    manifest = Manifest.from_json(_redoing(), "art")
    assert manifest.to_json() == _redoing()
    assert manifest.redo_program_of(3, 3) == manifest.redo_programs[3]
    assert manifest.redo_program_of(1, 2) == manifest.redo_programs[2] and manifest.redo_program_of(1) == manifest.redo_programs[0]


@pytest.mark.parametrize("path, value, message", [
    ("pipeline/redo_stage_programs/1/0", 7, "redo_stage_programs[1]: expected an integer in [0, 3], got 7"),
    ("pipeline/redo_stage_programs/0/1", 1, "rank 1's program in 'redo_stage_programs' is not its first stage's (0)"),
    ("pipeline/redo_stage_programs", DROP, "'pipeline' must hold exactly 'redo_stage_programs' and 'schedule' and"),
])
def test_a_pipeline_redo_record_titan_build_would_not_write_is_refused_in_one_line(path, value, message):
    doc = _edit(_redoing(), path, value)
    with pytest.raises(ValueError, match="rebuild") as e:
        Manifest.from_json(doc, "art")
    assert message in str(e.value) and "\n" not in str(e.value)


def _stage(**changes) -> dict:
    return {"index": 1, "stages": 3, "layers": [2, 4], "input_shape": [2, 64, 256], "output_shape": [2, 64, 256],
            "dtype": "float32"} | changes


def test_a_stage_record_reads_back_and_says_what_it_takes():
    io = StageIO.from_json(_stage(), "p")
    assert StageIO.from_json(io.to_json(), "p") == io
    assert io.expected_inputs() == {"tokens": 0, "activations": 1, "labels": 0}
    first = StageIO.from_json(_stage(index=0, input_shape=None), "p")
    last = StageIO.from_json(_stage(index=2, output_shape=None), "p")
    assert first.expected_inputs()["tokens"] == 1 and last.expected_inputs()["labels"] == 1
    # What its gathered parameters hold (titan-run gathers them once per step) reads back; a record
    # written without it reads as holding nothing.
    assert io.gathered_bytes == io.gathered_saved_bytes == 0 and "gathered_bytes" not in io.to_json()
    gathered = StageIO.from_json(_stage(gathered_bytes=4096, gathered_saved_bytes=1024), "p")
    assert (gathered.gathered_bytes, gathered.gathered_saved_bytes) == (4096, 1024)
    assert StageIO.from_json(gathered.to_json(), "p") == gathered
    assert "reads_tokens" not in io.to_json()  # written only when set: a record from before reads the same


def test_a_later_stage_under_the_document_mask_takes_the_tokens_too():
    io = StageIO.from_json(_stage(index=2, output_shape=None, reads_tokens=True), "p")
    assert io.reads_tokens and StageIO.from_json(io.to_json(), "p") == io
    assert io.expected_inputs() == {"tokens": 1, "activations": 1, "labels": 1}


@pytest.mark.parametrize("changes, message", [
    (dict(index=0), "only the first stage receives no activations and only the last sends none"),
    (dict(output_shape=None), "only the first stage receives no activations"),
    (dict(index=3), "stage index: expected an integer in [0, 2], got 3"),
    (dict(stages=1), "stage count: expected an integer in [2, 1024], got 1"),
    (dict(layers=[4, 4]), "stage layers: expected an integer in [5, 65536], got 4"),
    (dict(dtype="float64"), "activation dtype 'float64' is not one of float32, bfloat16"),
    (dict(input_shape=[2, -1, 256]), "input_shape"),
    (dict(reads_tokens=1), "reads_tokens must be true or false, and true only past the first stage"),
    (dict(index=0, input_shape=None, reads_tokens=True), "reads_tokens must be true or false, and true only past"),
    (dict(gathered_bytes=-1), "gathered_bytes: expected an integer"),
])
def test_a_stage_record_titan_build_would_not_write_is_refused(changes, message):
    with pytest.raises(ValueError) as e:
        StageIO.from_json(_stage(**changes), "p")
    assert message in str(e.value)

"""FlexAttention pipeline artifacts (titan-build --pp --attention flex, issue 31) train bit for bit
like PyTorch's own torch.distributed.pipelining running the same split and schedule class
(titan-verify: cli/tools/eager_pipeline.py), with the causal mask and with the document mask,
whose boundaries sit elsewhere in every micro-batch of every step. A stage past the first takes
the micro-batch's tokens beside the activations it receives and computes the document ids inside
its step (docs/pipeline.md); the eager reference gives every stage the same tokens. (The stages
against the whole model: unit/test_decoder_stage_documents.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import titan, write_documents, write_sidecar
from titan.runtime.data import TokenFile

STEPS = 10
EOS = 2047
FLEX = ("--flavor", "debug", "--n-layers", "4", "--attention", "flex")
DOCUMENT = ("--mask", "document", "--eos-id", str(EOS))


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("data") / "documents.u16", vocab=2048, eos=EOS)


def _build(tmp_path, *flags) -> str:
    out = tmp_path / "art"
    r = titan("build", *FLEX, *flags, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def _verify_bitwise(art, run_dir, data, *, ranks: int) -> list[float]:
    """titan-verify over STEPS steps on `data`, the clip acting (its norm spans the stages): every
    loss, gradient norm and parameter on every rank bitwise; returns the losses."""
    run_dir.mkdir()
    out = run_dir / "verify.json"
    r = titan("verify", art, "--steps", STEPS, "--max-norm", "0.2", "--data", data, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitwise equal: yes" in r.stdout and f"{ranks} ranks)" in r.stdout
    result = json.loads(out.read_text())
    assert result["eager"] == result["artifact"] and len(result["artifact"]) == STEPS
    assert min(float.fromhex(x) for x in result["artifact_grad_norm"]) > 0.2
    return [float.fromhex(x) for x in result["artifact"]]


def test_every_micro_batch_has_its_document_boundaries_elsewhere(documents_file):
    """What the pipeline tests train on: step s reads micro-batches (s - 1) M .. s M - 1."""
    data = TokenFile(documents_file, dtype="uint16", vocab_size=2048, batch_size=2, seq_len=128, dp_rank=0,
                     dp_degree=1)
    seen = [[torch.nonzero(row == EOS).flatten().tolist() for row in data.batch(i)[0]] for i in range(3 * STEPS)]
    assert all(seen[i] != seen[i + 1] for i in range(len(seen) - 1))
    assert all(len(row) >= 1 for batch in seen for row in batch)


@pytest.mark.slow  # two builds and two 10-step verifies: about 2 minutes on the 2-core machine
def test_a_1f1b_flex_pipeline_trains_bitwise_with_either_mask(documents_file, tmp_path):
    losses = {}
    for mask, flags in (("document", DOCUMENT), ("causal", ())):
        art = _build(tmp_path / mask, "--pp", "2", "--microbatches", "3", *flags)
        shown = titan("show", art, "--rank", "1", "--graph", "fw")
        assert shown.returncode == 0, shown.stderr
        described = f"flex document (eos id {EOS})" if mask == "document" else "flex causal"
        assert f"attention: {described}\n" in shown.stdout
        # The last stage's forward takes the tokens (for the ids) only under the document mask.
        assert ("int64[2,128]             tokens" in shown.stdout) == (mask == "document")
        losses[mask] = _verify_bitwise(art, tmp_path / mask / "run", documents_file, ranks=2)
    # The document mask is in effect: the same tokens give other losses than the causal mask.
    assert all(a != b for a, b in zip(losses["causal"], losses["document"]))


@pytest.mark.slow  # a build of four stage traces and a 10-step verify: about 2 minutes
def test_a_zbv_flex_document_pipeline_trains_bitwise(documents_file, tmp_path):
    """Each rank holds two stages in a V; rank 0 the first and the last, which both read the tokens."""
    art = _build(tmp_path, "--pp", "2", "--pp-schedule", "zbv", "--microbatches", "3", *DOCUMENT)
    _verify_bitwise(art, tmp_path / "run", documents_file, ranks=2)


def test_a_token_file_with_another_separator_is_refused_by_a_pipeline(documents_file, tmp_path):
    art = _build(tmp_path, "--pp", "2", "--microbatches", "2", *DOCUMENT)
    data = tmp_path / "other.u16"
    data.write_bytes(documents_file.read_bytes())
    write_sidecar(data, data.stat().st_size // 2, 5)
    r = titan("run", art, "--steps", 1, "--data", data)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert f"masks documents that end with token {EOS}; " in r.stderr


@pytest.mark.parametrize("flags, message", [
    (("--mask", "document", "--eos-id", "1"), "--mask document needs --attention flex"),
    (("--attention", "flex", "--mask", "document"), "--mask document needs --eos-id ID"),
    (("--attention", "flex", "--eos-id", "1"), "--eos-id is for --mask document only"),
])
def test_what_a_flex_pipeline_cannot_be_is_one_line(flags, message):
    r = titan("build", "--flavor", "debug", "--pp", "2", *flags)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert message in r.stderr

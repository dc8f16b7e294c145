"""FlexAttention artifacts (titan-build --attention flex, issue 31) train bit for bit like eager
PyTorch at tp 2 and dp-shard 2 (DeepSeek-V3's latent attention also at ep 2), with the causal
mask and with the document mask whose document boundaries sit elsewhere in every step's batch:
the mask is data computed inside the step, so one artifact serves every batch. The eager reference runs the same model code, whose attention
is titan::flex_attention: PyTorch's eager FlexAttention math on CPU (unit/test_flex_attention.py
ties the two, and holds the op's contract: its dense reference, its refusals)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_every_rank_equals_eager, titan, write_documents, write_sidecar
from titan.builder.models.attention import describe_attention
from titan.runtime.data import TokenFile

STEPS = 10
EOS = 2047
LAYOUTS = [dict(tp=2), dict(dp_shard=2)]
DEEPSEEK_EOS = 511


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("data") / "documents.u16", vocab=2048, eos=EOS)


@pytest.fixture(scope="module")
def deepseek_documents(tmp_path_factory):
    """The same documents in DeepSeek-V3 debug's vocabulary of 512."""
    return write_documents(tmp_path_factory.mktemp("data") / "documents512.u16", vocab=512, eos=DEEPSEEK_EOS)


def _boundaries(path, step: int, *, vocab: int, eos: int) -> list[list[int]]:
    data = TokenFile(path, dtype="uint16", vocab_size=vocab, batch_size=2, seq_len=128, dp_rank=0, dp_degree=1)
    tokens, _ = data.batch(step)
    return [torch.nonzero(row == eos).flatten().tolist() for row in tokens]


@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_the_document_boundaries_move_at_every_step(model, documents_file, deepseek_documents):
    path, vocab, eos = (documents_file, 2048, EOS) if model == "llama3" else (deepseek_documents, 512, DEEPSEEK_EOS)
    seen = [_boundaries(path, step, vocab=vocab, eos=eos) for step in range(STEPS)]
    assert all(seen[i] != seen[i + 1] for i in range(STEPS - 1))
    assert all(len(row) >= 1 for batch in seen for row in batch)


@pytest.mark.slow  # builds and trains artifacts: 30-80 s on the 2-core machine
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_flex_attention_causal_and_document_equal_eager_at_every_step(layout, debug_artifact, documents_file,
                                                                       tmp_path):
    losses = {}
    for mask in ("causal", "document"):
        flags = ("--attention", "flex", "--mask", mask) + (("--eos-id", str(EOS)) if mask == "document" else ())
        art = debug_artifact(**layout, extra=flags)
        manifest = json.loads((art / "manifest.json").read_text())
        assert describe_attention(manifest["model_config"]) == \
            ("flex causal" if mask == "causal" else f"flex document (eos id {EOS})")
        run = tmp_path / mask
        run.mkdir()
        result = assert_every_rank_equals_eager(art, run, steps=STEPS, ranks=2, extra=("--data", documents_file))
        assert len(result["artifact"]) == STEPS
        losses[mask] = result["artifact"]
    # The document mask is in effect: the same tokens give other losses than the causal mask.
    assert all(a != b for a, b in zip(losses["causal"], losses["document"]))


@pytest.mark.parametrize("eos_id,fix", [(5, "rebuild it with --eos-id 5"), (None, "titan-data --eos")])
def test_a_token_file_with_another_separator_is_refused(eos_id, fix, debug_artifact, documents_file, tmp_path):
    art = debug_artifact(tp=2, extra=("--attention", "flex", "--mask", "document", "--eos-id", str(EOS)))
    data = tmp_path / "other.u16"
    data.write_bytes(documents_file.read_bytes())
    write_sidecar(data, data.stat().st_size // 2, eos_id)
    r = titan("run", art, "--steps", 1, "--data", data)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert f"masks documents that end with token {EOS}; " in r.stderr and fix in r.stderr


@pytest.mark.slow  # builds and trains artifacts: 30-80 s on the 2-core machine
def test_qwen3_flex_document_equals_eager(debug_artifact, tmp_path):
    """Qwen3 shares the decoder's attention (with its per-head q/k norms): the same choice, tied
    embeddings, at tp 2 x dp-shard 2."""
    data = write_documents(tmp_path / "documents.u16", vocab=512, eos=511)
    art = debug_artifact(tp=2, dp_shard=2, extra=("--model", "qwen3", "--attention", "flex", "--mask", "document",
                                                  "--eos-id", "511"))
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", 4, "--data", data, "--json", out)
    assert r.returncode == 0 and "bitwise equal: yes" in r.stdout, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["parameters_differing"] == 0 and result["eager"] == result["artifact"]


@pytest.mark.slow  # builds and trains an artifact: ~100 s on the 2-core machine under load
@pytest.mark.parametrize("layout", ["--tp", "--dp-shard", "--ep"])
def test_deepseek_v3_latent_attention_flex_document_equals_eager(layout, deepseek_documents, tmp_path):
    """DeepSeek-V3's multi-head latent attention through the flex op, its values at their own
    head size (16 in debug against 24 for queries and keys: no padding, unlike SDPA), with the
    document mask over boundaries that move at every step: bitwise at tp 2, dp-shard 2 and ep 2."""
    art = tmp_path / "art"
    r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", layout, 2, "--attention", "flex", "--mask",
              "document", "--eos-id", DEEPSEEK_EOS, "--out", art)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((art / "manifest.json").read_text())
    assert describe_attention(manifest["model_config"]) == f"flex document (eos id {DEEPSEEK_EOS})"
    forward = titan("show", art, "--graph", "fw").stdout
    heads = 2 if layout == "--tp" else 4
    assert forward.count(f"(float32[2,{heads},128,16], float32[2,{heads},128]) = titan.flex_attention.default(") == 3
    assert "titan.attention.default" not in forward
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", 6, "--data", deepseek_documents, "--json", out)
    assert r.returncode == 0 and "bitwise equal: yes" in r.stdout, r.stdout + r.stderr
    assert "parameters after step 6: all bitwise equal" in r.stdout
    result = json.loads(out.read_text())
    assert result["parameters_differing"] == 0 and result["eager"] == result["artifact"] and len(result["eager"]) == 6


@pytest.mark.slow  # builds and trains an artifact: ~100 s on the 2-core machine under load
def test_deepseek_v3_latent_attention_flex_documents_through_a_pipeline_equals_eager(deepseek_documents, tmp_path):
    """At pp 2 every stage's latent attention is the flex op with the document mask (a stage past
    the first finds the documents in the micro-batch's tokens it reads: docs/pipeline.md)."""
    art = tmp_path / "art"
    r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", "--pp", 2, "--attention", "flex", "--mask",
              "document", "--eos-id", 511, "--out", art)
    assert r.returncode == 0, r.stderr
    assert "titan.flex_attention.default(" in titan("show", art, "--graph", "fw").stdout
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", 3, "--data", deepseek_documents, "--json", out)
    assert r.returncode == 0 and "bitwise equal: yes" in r.stdout, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["parameters_differing"] == 0 and result["eager"] == result["artifact"] and len(result["eager"]) == 3


@pytest.mark.slow  # builds and trains artifacts: 30-80 s on the 2-core machine
def test_selective_checkpointing_keeps_flex_attention_outputs_and_stays_bitwise(debug_artifact, documents_file,
                                                                               tmp_path):
    """--ac selective recomputes the cheap ops only: the dense flex kernel is not run again in the
    backward (as for SDPA), and training stays bitwise."""
    art = debug_artifact(tp=2, extra=("--attention", "flex", "--mask", "document", "--eos-id", str(EOS),
                                      "--ac", "selective"))
    backward = titan("show", art, "--graph", "bw").stdout
    assert "titan.flex_attention_backward.default" in backward and "titan.flex_attention.default" not in backward
    assert_every_rank_equals_eager(art, tmp_path, steps=3, ranks=2, extra=("--data", documents_file))


@pytest.mark.parametrize("flags,why", [
    (("--mask", "document", "--eos-id", "3"), "--mask document needs --attention flex"),
    (("--attention", "flex", "--mask", "document"), "--mask document needs --eos-id ID"),
    (("--model", "deepseek_v3", "--attention", "flex", "--eos-id", "511"), "--eos-id is for --mask document only"),
    (("--attention", "flash"), "'flash' is not one of 'sdpa', 'flex'"),
])
def test_bad_attention_flags_are_one_line_errors(flags, why, tmp_path):
    r = titan("build", "--flavor", "debug", "--out", tmp_path / "art", *flags)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert why in r.stderr and not (tmp_path / "art").exists()

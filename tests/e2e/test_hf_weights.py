"""Hugging Face Llama weights: titan-run --init-from-hf trains from them (first-step loss equal
to transformers' on the same weights and tokens), titan-export writes them back bit for bit,
and bad checkpoints are refused with one line. (A shard's rows read in process:
unit/test_hf_weights_rows.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import read_metrics, titan
from hf_llama import hf_dir, hf_model, save_hf_model, transformers  # noqa: F401 (a fixture)
from titan.runtime.contract.artifact import open_artifact

SEQ_LEN = 128
FP32 = ("--dtype", "fp32")


@pytest.fixture(scope="module")
def hf_sharded_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama-debug-sharded"
    save_hf_model(path, max_shard_size="1MB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    tokens = torch.randint(0, 2048, (8 * SEQ_LEN + 1,), generator=torch.Generator().manual_seed(3))
    path = tmp_path_factory.mktemp("data") / "tokens.u16"
    path.write_bytes(tokens.numpy().astype(np.uint16).tobytes())
    return path


def _first_batch(token_file, n_sequences: int) -> torch.Tensor:
    # runtime/data.py: at step 0 the global batch is windows 0 .. dp * batch - 1, window i being
    # tokens [i * seq_len, i * seq_len + seq_len + 1).
    tokens = torch.from_numpy(np.fromfile(token_file, dtype=np.uint16).astype(np.int64))
    return torch.stack([tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in range(n_sequences)])


def _hf_loss(model, seq: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=seq[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), seq[:, 1:].flatten()).item()


@pytest.mark.parametrize("layout, storage", [(dict(tp=2), "single"), (dict(dp_shard=2), "sharded")],
                         ids=["tp2-model.safetensors", "dp_shard2-index.json"])
def test_first_step_loss_matches_transformers(layout, storage, hf_dir, hf_sharded_dir, token_file, debug_artifact,
                                              tmp_path):
    source = hf_dir if storage == "single" else hf_sharded_dir
    art = debug_artifact(**layout, extra=FP32)
    metrics = tmp_path / "metrics.jsonl"
    r = titan("run", art, "--init-from-hf", source, "--steps", 1, "--data", token_file, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    titan_loss = read_metrics(metrics)[0]["loss"]

    manifest = open_artifact(art).manifest
    n_seq = manifest.batch_size * manifest.dp_degree
    seq = _first_batch(token_file, n_seq)
    model = transformers.LlamaForCausalLM.from_pretrained(source, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    reference = _hf_loss(model, seq)
    # fp32 throughout; the two differ only in summation order (titan's CPU flash attention vs
    # eager softmax attention, matmul blocking): measured ~1e-7 relative. 1e-5 relative is ~85
    # fp32 ulps at this loss, far below what a mapping error costs (next assertion).
    print(f"titan {titan_loss!r} transformers {reference!r} relative {abs(titan_loss - reference) / reference:.2e}")
    assert titan_loss == pytest.approx(reference, rel=1e-5), (titan_loss, reference)

    # The tolerance would catch a loader that forgot to undo HF's q/k row permutation.
    hd = 256 // 8
    hf_rows = torch.arange(hd).view(2, hd // 2).t().reshape(-1)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.copy_(proj.weight.unflatten(0, (-1, hd))[:, hf_rows].flatten(0, 1))
    unpermuted = _hf_loss(model, seq)
    print(f"with q/k rows left in HF order: {unpermuted!r}")
    assert abs(unpermuted - reference) > 100 * 1e-5 * reference


def _hf_tensors(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize("layout, source, dtype", [(dict(tp=2), "fp32", "fp32"),
                                                   pytest.param(dict(dp_shard=3), "bf16", "bf16", marks=pytest.mark.slow)],
                         ids=["tp2-fp32", "dp_shard3-bf16-sharded"])
def test_export_round_trip_is_bit_exact(layout, source, dtype, hf_dir, debug_artifact, tmp_path):
    """HF -> titan-run --init-from-hf --steps 0 (checkpoints the loaded weights, trains nothing)
    -> titan-export -> every tensor equal to the original (bf16 weights are held exactly in the
    fp32 master weights, so they come back exactly with --dtype bf16). dp_shard=3 pads its
    shards: only their real rows reach the checkpoint."""
    if source == "fp32":
        original_dir = hf_dir
    else:
        original_dir = tmp_path / "bf16"
        hf_model().to(torch.bfloat16).save_pretrained(original_dir, safe_serialization=True, max_shard_size="1MB")
    art = debug_artifact(**layout, extra=FP32)
    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    r = titan("run", art, "--init-from-hf", original_dir, "--steps", 0, "--checkpoint-dir", ckpt)
    assert r.returncode == 0, r.stderr
    assert (ckpt / "step-00000000" / "titan.json").is_file()
    r = titan("export", ckpt, "--hf", out, "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    original, exported = _hf_tensors(original_dir), _hf_tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = transformers.LlamaConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_key_value_heads, config.intermediate_size) == (256, 4, 704)
    assert titan("export", ckpt, "--hf", out).returncode == 2, "an existing --hf directory is never overwritten"


def test_tied_embeddings_load_the_output_from_the_embedding(debug_artifact, token_file, tmp_path):
    hf = tmp_path / "tied"
    save_hf_model(hf, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(hf / "model.safetensors")
    art = debug_artifact(tp=2, extra=FP32)
    metrics = tmp_path / "metrics.jsonl"
    r = titan("run", art, "--init-from-hf", hf, "--steps", 1, "--data", token_file, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    model = transformers.LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    assert read_metrics(metrics)[0]["loss"] == pytest.approx(_hf_loss(model, _first_batch(token_file, 2)), rel=1e-5)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _missing_config(p):
    (p / "config.json").unlink()


def _garbled_config(p):
    (p / "config.json").write_text('{"hidden_size": 256,')


def _wrong_width(p):
    _edit_config(p, hidden_size=512)


def _rope_scaling(p):
    _edit_config(p, rope_scaling={"rope_type": "llama3", "factor": 8.0}, rope_parameters=None)


def _wrong_tensor_shape(p):
    tensors = load_file(p / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:640].clone()
    save_file(tensors, p / "model.safetensors", metadata={"format": "pt"})


def _missing_tensor(p):
    tensors = load_file(p / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, p / "model.safetensors", metadata={"format": "pt"})


def _integer_tensor(p):
    tensors = load_file(p / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int64)  # was cast silently
    save_file(tensors, p / "model.safetensors", metadata={"format": "pt"})


def _garbled_weights(p):
    (p / "model.safetensors").write_bytes(b"\x00" * 64)


@pytest.mark.parametrize("damage, words", [
    (_missing_config, ["no config.json", "Hugging Face model directory"]),
    (_garbled_config, ["not valid JSON"]),
    (_wrong_width, ["hidden_size 512 (artifact: 256)", "titan-build"]),
    (_rope_scaling, ["RoPE scaling 'llama3' is not implemented"]),
    (_wrong_tensor_shape, ["model.layers.1.mlp.up_proj.weight has shape [640, 256]", "[704, 256]"]),
    (_missing_tensor, ["no tensor model.norm.weight"]),
    (_integer_tensor, ["model.norm.weight is stored as I64, not a float dtype"]),
    (_garbled_weights, ["not a readable safetensors file"]),
], ids=lambda v: v.__name__.strip("_") if callable(v) else "")
def test_bad_hf_checkpoint_is_refused_in_one_line(damage, words, hf_dir, debug_artifact, tmp_path):
    bad = _copy(hf_dir, tmp_path / "bad")
    damage(bad)
    r = titan("run", debug_artifact(tp=2, extra=FP32), "--init-from-hf", bad, "--steps", 1)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]

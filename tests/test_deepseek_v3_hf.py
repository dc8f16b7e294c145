"""DeepSeek-V3 Hugging Face checkpoints: a tiny transformers DeepseekV3ForCausalLM saved with
save_pretrained (safetensors), read through the artifact's hf_checkpoint record exactly as
--init-from-hf reads it (runtime/hf_weights.py: one tensor per expert stacked on the expert
dim, the balancing bias included), gives titan's model the same first-step loss on the same
tokens: the model on one rank, on two expert-parallel ranks (each reads only its own experts),
and `titan-build --ep 2` + `titan-run --init-from-hf`."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import param_spec, read_metrics, titan
from test_deepseek_v3 import CFG, _batch, _run_ep_ranks
from titan.builder.models.deepseek_v3 import SPEC
from titan.builder.models.moe.expert_parallel import set_dispatch
from titan.builder.models.deepseek_v3.hf_names import BALANCING_BIAS, hf_config_kwargs
from titan.builder.models.deepseek_v3.model import DeepSeekV3
from titan.runtime.hf_weights import HFCheckpoint

transformers = pytest.importorskip("transformers")
EP2 = ("--model", "deepseek_v3", "--ep", "2")
"""titan-build flags of the debug DeepSeek-V3 artifact with two expert-parallel ranks."""


def save_hf_model(cfg, path) -> torch.nn.Module:
    """A transformers DeepseekV3ForCausalLM of `cfg`'s shapes with every weight drawn (transformers
    initializes the router to zero and the balancing bias to zero, which would hide a wrong
    expert order), saved with save_pretrained; returns the model (eager attention)."""
    torch.manual_seed(0)
    hf_cfg = transformers.DeepseekV3Config(**hf_config_kwargs(cfg))
    hf_cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.01)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_loss(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


def titan_tensors(cfg) -> list:
    """The parameters and balancing biases of `cfg`'s model, whole (no slices)."""
    with torch.device("meta"):
        model = DeepSeekV3(cfg)
    biases = [(fqn, b) for fqn, b in model.named_buffers() if fqn.endswith(BALANCING_BIAS)]
    tensors = [*model.named_parameters(), *biases]
    assert all(t.dtype == torch.float32 for _, t in tensors)
    return [param_spec(fqn, list(t.shape), []) for fqn, t in tensors]


def read_through_record(cfg, path) -> dict[str, torch.Tensor]:
    """Every parameter and balancing bias read from `path` as --init-from-hf reads them."""
    record = SPEC.hf_checkpoint(cfg, list(SPEC.init_specs(cfg)))
    ckpt = HFCheckpoint(path, record=record)
    try:
        return {p.fqn: ckpt.read_shard(p, device=torch.device("cpu")) for p in titan_tensors(cfg)}
    finally:
        ckpt.close()


def titan_loss(cfg, state: dict, batch: dict) -> torch.Tensor:
    model = DeepSeekV3(cfg)
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(k.endswith(("tokens_per_expert", "dropped_tokens")) for k in missing), missing
    model.loss_scale = float(batch["tokens"].numel())
    set_dispatch(model, tokens=batch["tokens"].numel())
    with torch.no_grad():
        return model(batch["tokens"], batch["labels"])


@pytest.fixture(scope="module")
def hf_debug(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "deepseek-v3-debug"
    model = save_hf_model(CFG, path)
    return path, hf_loss(model, _batch())


def test_checkpoint_holds_one_tensor_per_expert_and_the_record_names_every_tensor(hf_debug):
    """What save_pretrained writes (and the published checkpoints hold): per-expert tensors, not
    transformers' in-memory fused gate_up_proj; the record accounts for every tensor but the
    ones titan's model has no use for."""
    from safetensors import safe_open

    path, _ = hf_debug
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    assert not any("gate_up_proj" in name for name in on_disk)
    record = SPEC.hf_checkpoint(CFG, list(SPEC.init_specs(CFG)))
    read = set(record.names.values())
    for fqn in record.stacked:
        read |= set(record.hf_names(fqn, CFG.n_routed_experts))
    assert read == on_disk


def test_first_step_loss_matches_transformers_on_one_rank(hf_debug):
    """Same weights (read from the saved checkpoint through the record), same tokens: the losses
    are equal to float32 rounding (rtol 1e-6; 6.3142629 vs 6.3142624 here, 4.8e-7 apart). Both
    compute the same math, but transformers sums expert outputs by index_add in expert order and
    runs attention as explicit matmuls, titan sums a token's experts in routing order and runs
    the flash-attention kernel, so equality is not promised."""
    path, expected = hf_debug
    loss = titan_loss(CFG, read_through_record(CFG, path), _batch())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def test_first_step_loss_matches_transformers_with_two_expert_parallel_ranks(hf_debug, tmp_path):
    """Each expert-parallel rank reads only its own experts (its slice of the expert dim, as the
    artifact's rank metadata cuts it) and the two ranks' loss agrees with transformers' to
    rtol 1e-5 (the expert outputs are summed in another order than on one rank)."""
    path, expected = hf_debug
    full = read_through_record(CFG, path)
    record = SPEC.hf_checkpoint(CFG, list(SPEC.init_specs(CFG)))
    ckpt = HFCheckpoint(path, record=record)
    try:
        for fqn in record.stacked:
            shape = list(full[fqn].shape)
            for rank in range(2):
                part = ckpt.read_shard(param_spec(fqn, shape, [[0, 2, rank]]), device=torch.device("cpu"))
                assert torch.equal(part, full[fqn].chunk(2)[rank])
    finally:
        ckpt.close()
    for out in _run_ep_ranks(tmp_path / "ep2", full, _batch()):
        torch.testing.assert_close(out["eager.loss"], expected, rtol=1e-5, atol=0)


def test_yarn_checkpoint_config_is_accepted_and_matches(tmp_path):
    """671B's YaRN context extension, active on the debug shapes by a short original context:
    the saved config.json's rope parameters pass the record's check, and one rank's loss
    matches transformers' (rtol 1e-5); a plain-RoPE checkpoint is refused for this model."""
    cfg = dataclasses.replace(CFG, rope_factor=4.0, rope_original_seq_len=8, rope_mscale=0.707)
    model = save_hf_model(cfg, tmp_path / "yarn")
    batch = _batch()
    expected = hf_loss(model, batch)
    loss = titan_loss(cfg, read_through_record(cfg, tmp_path / "yarn"), batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    plain = save_hf_model(CFG, tmp_path / "plain")
    assert not torch.equal(hf_loss(plain, batch), expected), "YaRN changed nothing: the test would not see it"
    with pytest.raises(ValueError, match="RoPE scaling 'default' is not implemented by this artifact's model"):
        HFCheckpoint(tmp_path / "plain", record=SPEC.hf_checkpoint(cfg, list(SPEC.init_specs(cfg))))


def test_export_round_trip_with_two_expert_parallel_ranks(hf_debug, debug_artifact, tmp_path):
    """Hugging Face -> `titan-run --init-from-hf --steps 0 --checkpoint-dir` on the ep=2 artifact
    (each rank holds half the experts) -> `titan-export`: every tensor of the checkpoint comes
    back bit for bit, one tensor per expert and the balancing bias included, and transformers
    loads the written directory to the same loss."""
    from safetensors.torch import load_file

    path, expected = hf_debug
    art, ckpt, out = debug_artifact(extra=EP2), tmp_path / "ckpt", tmp_path / "exported"
    r = titan("run", art, "--init-from-hf", path, "--steps", 0, "--checkpoint-dir", ckpt)
    assert r.returncode == 0, r.stderr
    r = titan("export", ckpt, "--hf", out)
    assert r.returncode == 0, r.stderr
    original, written = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == written.keys()
    assert all(torch.equal(original[k], written[k]) for k in original)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert torch.equal(hf_loss(model.eval(), _batch()), expected)


def test_titan_run_from_the_checkpoint_with_two_expert_parallel_ranks(hf_debug, debug_artifact, tmp_path):
    """`titan-run --init-from-hf` on the ep=2 debug artifact (float32): the first step's loss is
    transformers' on the same global batch to rtol 1e-5 (here 6.3179855 vs 6.3179860: 4.8e-7
    apart, float32 summation order), and the same weights with the balancing bias left at zero
    give a loss 5.5e-4 away, 9 times that tolerance (so the bias came from the checkpoint too)."""
    path, _ = hf_debug
    ep2_artifact = debug_artifact(extra=EP2)
    manifest = json.loads((ep2_artifact / "manifest.json").read_text())
    seq_len, n_seq = manifest["seq_len"], manifest["batch_size"] * manifest["layout"]["ep"]
    tokens = torch.randint(0, CFG.vocab_size, (n_seq * seq_len + 1,), generator=torch.Generator().manual_seed(3))
    token_file = tmp_path / "tokens.u16"
    token_file.write_bytes(tokens.numpy().astype(np.uint16).tobytes())
    metrics = tmp_path / "metrics.jsonl"
    r = titan("run", ep2_artifact, "--init-from-hf", path, "--steps", 1, "--data", token_file, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    record = read_metrics(metrics)[0]

    # runtime/data.py: step 0's global batch is windows 0 .. n_seq - 1 of seq_len + 1 tokens.
    windows = torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n_seq)])
    batch = {"tokens": windows[:, :-1], "labels": windows[:, 1:]}
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    reference = hf_loss(model, batch).item()
    assert record["loss"] == pytest.approx(reference, rel=1e-5), (record["loss"], reference)
    state = read_through_record(CFG, path)
    unbiased = titan_loss(CFG, {k: torch.zeros_like(v) if k.endswith(BALANCING_BIAS) else v
                                for k, v in state.items()}, batch).item()
    print(f"titan {record['loss']!r} transformers {reference!r} with a zero bias {unbiased!r}")
    assert abs(unbiased - reference) > 5 * 1e-5 * reference
    # Dropless, and the expert load of the step as the metrics report it.
    assert record["dropped_tokens"] == 0
    assert record["expert_load_mean"] == n_seq * seq_len * CFG.top_k / CFG.n_routed_experts

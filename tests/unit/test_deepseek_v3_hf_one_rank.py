"""DeepSeek-V3 Hugging Face checkpoints in process: what save_pretrained writes is what the
artifact's hf_checkpoint record names, and titan's model given the weights read through the
record (as --init-from-hf reads them) has transformers' first-step loss on one rank, YaRN
included. (Expert-parallel ranks, titan-run and titan-export: e2e/test_deepseek_v3_hf.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepseek_debug import CFG, debug_batch
from hf_deepseek import hf_debug, hf_loss, read_through_record, save_hf_model, titan_loss  # noqa: F401 (a fixture)
from titan.builder.models.deepseek_v3 import SPEC
from titan.runtime.hf_weights import HFCheckpoint


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
    loss = titan_loss(CFG, read_through_record(CFG, path), debug_batch())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def test_yarn_checkpoint_config_is_accepted_and_matches(tmp_path):
    """671B's YaRN context extension, active on the debug shapes by a short original context:
    the saved config.json's rope parameters pass the record's check, and one rank's loss
    matches transformers' (rtol 1e-5); a plain-RoPE checkpoint is refused for this model."""
    cfg = dataclasses.replace(CFG, rope_factor=4.0, rope_original_seq_len=8, rope_mscale=0.707)
    model = save_hf_model(cfg, tmp_path / "yarn")
    batch = debug_batch()
    expected = hf_loss(model, batch)
    loss = titan_loss(cfg, read_through_record(cfg, tmp_path / "yarn"), batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    plain = save_hf_model(CFG, tmp_path / "plain")
    assert not torch.equal(hf_loss(plain, batch), expected), "YaRN changed nothing: the test would not see it"
    with pytest.raises(ValueError, match="RoPE scaling 'default' is not implemented by this artifact's model"):
        HFCheckpoint(tmp_path / "plain", record=SPEC.hf_checkpoint(cfg, list(SPEC.init_specs(cfg))))

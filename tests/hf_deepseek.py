"""The debug DeepSeek-V3 against its Hugging Face reference (tests of every tier): a tiny
transformers DeepseekV3ForCausalLM saved with save_pretrained, its loss, and titan's model and
parameters read through the artifact's hf_checkpoint record as --init-from-hf reads them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import param_spec
from deepseek_debug import CFG, debug_batch
from titan.builder.models.deepseek_v3 import SPEC
from titan.builder.models.moe.expert_parallel import set_dispatch
from titan.builder.models.deepseek_v3.hf_names import BALANCING_BIAS, hf_config_kwargs
from titan.builder.models.deepseek_v3.model import DeepSeekV3
from titan.runtime.hf_weights import HFCheckpoint

transformers = pytest.importorskip("transformers")


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
    """The debug checkpoint, saved once per test module, and transformers' loss on debug_batch()."""
    path = tmp_path_factory.mktemp("hf") / "deepseek-v3-debug"
    model = save_hf_model(CFG, path)
    return path, hf_loss(model, debug_batch())

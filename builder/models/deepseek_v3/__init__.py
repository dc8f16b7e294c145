"""DeepSeek-V3 (multi-head latent attention, a mixture of experts with expert parallelism):
shapes (config.py), module code (model.py, moe.py), parameter init (init.py), the token dispatch (dispatch.py), expert
layout (expert_parallel.py) and transformers' names (hf_names.py), behind one ModelSpec.
Importing this imports no torch.

Not in the registry yet: the build pipeline must first carry the MoE layers' state buffers and
an `ep` mesh dimension (README.md, "Not wired yet").
"""

from __future__ import annotations

from titan.builder.layout import require_divides
from titan.builder.models.deepseek_v3.config import FLAVORS, DeepSeekV3Config
from titan.builder.models.deepseek_v3.init import init_specs
from titan.builder.models.spec import ModelSpec, lazy
from titan.runtime.contract.layout import Layout


def _tp_plan(model) -> dict:
    raise AssertionError("check_layout refuses --tp > 1 for deepseek_v3")


def check_layout(cfg: DeepSeekV3Config, layout: Layout) -> None:
    """Raise ValueError, naming the reason, when the layout does not fit the model."""
    if layout.tp > 1:
        raise ValueError("deepseek_v3 has no tensor-parallel plan yet; build it with --tp 1")
    qk = cfg.n_heads * cfg.qk_head_dim
    # FSDP shards dim 0 of every parameter (the stacked experts: the expert dim).
    dim0s = {"embedding rows": cfg.vocab_size, "model width": cfg.dim, "query projection rows": qk,
             "key/value latent rows": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
             "key/value projection rows": cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
             "dense feed-forward rows": cfg.dense_hidden, "routed experts": cfg.n_routed_experts,
             "shared expert rows": cfg.moe_hidden * cfg.n_shared_experts}
    if cfg.q_lora_rank:
        dim0s["query latent rows"] = cfg.q_lora_rank
    require_divides("dp-shard", layout.dp_shard, dim0s)


def region_kind(module: str) -> str | None:
    """Only the norms are fused: the MoE blocks' dispatch is not a SwiGLU region."""
    return "rms_norm" if module.rsplit(".", 1)[-1] in ("attention_norm", "ffn_norm", "norm") else None


SPEC = ModelSpec(
    name="deepseek_v3",
    flavors=FLAVORS,
    build=lazy("titan.builder.models.deepseek_v3.model:DeepSeekV3"),
    tp_plan=_tp_plan,
    init_specs=init_specs,
    check_layout=check_layout,
    region_kind=region_kind,
)

"""DeepSeek-V3 (multi-head latent attention, a mixture of experts with expert parallelism):
shapes (config.py), module code (model.py, moe.py), parameter init (init.py), tensor-parallel plan (tp_plan.py), transformers' names (hf_names.py) and pipeline stage costs (stage_costs.py), behind
one ModelSpec. The token dispatch and the expert layout are builder/models/moe's, shared with
Qwen3. Importing this imports no torch.
"""

from __future__ import annotations

from titan.builder.models.spec import require_divides
from titan.builder.models.deepseek_v3.config import FLAVORS, DeepSeekV3Config, check_shape
from titan.builder.models.deepseek_v3.hf_names import hf_checkpoint
from titan.builder.models.deepseek_v3.init import init_specs
from titan.builder.models.deepseek_v3.stage_costs import stage_costs
from titan.builder.models.moe import buffer_metric, check_expert_tp, is_expert_param
from titan.builder.models.spec import ModelSpec, lazy
from titan.runtime.contract.layout import Layout


def check_layout(cfg: DeepSeekV3Config, layout: Layout) -> None:
    """Raise ValueError, naming the reason, when the layout does not fit the model."""
    require_divides("tp", layout.tp, {"attention heads": cfg.n_heads,
                                      "dense feed-forward hidden width": cfg.dense_hidden,
                                      "vocabulary size": cfg.vocab_size})
    require_divides("ep", layout.ep, {"routed experts": cfg.n_routed_experts})
    check_expert_tp(cfg.etp, layout, moe_hidden=cfg.moe_hidden)
    qk = cfg.n_heads * cfg.qk_head_dim
    # FSDP shards dim 0 of every parameter (the stacked experts: the expert dim).
    dim0s = {"embedding rows": cfg.vocab_size, "model width": cfg.dim, "query projection rows": qk,
             "key/value latent rows": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
             "key/value projection rows": cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
             "dense feed-forward rows": cfg.dense_hidden,
             "routed experts per --ep rank": cfg.n_routed_experts // layout.ep,
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
    tp_plan=lazy("titan.builder.models.deepseek_v3.tp_plan:tp_plan"),
    init_specs=init_specs,
    check_shape=check_shape,
    check_layout=check_layout,
    region_kind=region_kind,
    expert_param=is_expert_param,
    has_experts=lambda cfg: True,
    place_rank=lazy("titan.builder.models.moe.expert_parallel:place_rank"),
    buffer_metric=buffer_metric,
    leading_layers=lambda cfg: cfg.n_dense_layers,
    # Measured on an H100 (benchmarks/gpu/gpu_deepseek.sh, --deterministic): with fuse_exact's regions
    # the parameters left eager's bits after the first step; without them every step is bitwise.
    exact_fusion=False,
    hf_checkpoint=hf_checkpoint,
    stage_costs=stage_costs,
)

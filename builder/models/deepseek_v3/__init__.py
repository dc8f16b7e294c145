"""DeepSeek-V3 (multi-head latent attention, a mixture of experts with expert parallelism):
shapes (config.py), module code (model.py, moe.py), parameter init (init.py), the token dispatch (dispatch.py), expert
layout (expert_parallel.py) and transformers' names (hf_names.py), behind one ModelSpec.
Importing this imports no torch.

Not in the registry yet: the build pipeline must first carry the MoE layers' state buffers and
an `ep` mesh dimension (README.md, "Not wired yet").
"""

from __future__ import annotations

from titan.builder.models.deepseek_v3.config import DEFAULT_FLAVOR, FLAVORS, DeepSeekV3Config
from titan.builder.models.deepseek_v3.init import init_specs
from titan.builder.models.llama3.naming import ac_block, block_of
from titan.builder.models.spec import ModelSpec
from titan.runtime.contract.layout import MESH_DIMS, Layout


def _build(cfg: DeepSeekV3Config):
    from titan.builder.models.deepseek_v3.model import DeepSeekV3
    return DeepSeekV3(cfg)


def _tp_plan(model) -> dict:
    raise AssertionError("check_layout refuses --tp > 1 for deepseek_v3")


def check_layout(cfg: DeepSeekV3Config, layout: Layout) -> None:
    """Raise ValueError, naming the reason, when the layout does not fit the model."""
    for name in MESH_DIMS:
        if getattr(layout, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(layout, name)}")
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
    for what, value in dim0s.items():
        if value % layout.dp_shard:
            raise ValueError(f"--dp-shard {layout.dp_shard} does not divide the {what} ({value}) of this model; "
                             "pick a --dp-shard that divides it")


def region_kind(module: str) -> str | None:
    """Only the norms are fused: the MoE blocks' dispatch is not a SwiGLU region."""
    return "rms_norm" if module.rsplit(".", 1)[-1] in ("attention_norm", "ffn_norm", "norm") else None


SPEC = ModelSpec(
    name="deepseek_v3",
    flavors=FLAVORS,
    default_flavor=DEFAULT_FLAVOR,
    config_from_dict=lambda d: DeepSeekV3Config(**d),
    build=_build,
    init_specs=init_specs,
    tp_plan=_tp_plan,
    check_layout=check_layout,
    block_of=block_of,
    ac_block=ac_block,
    region_kind=region_kind,
)

"""What the mixture-of-experts families (deepseek_v3, qwen3) share: the static-buffer token
dispatch (dispatch.py), the expert-parallel placement of a model's MoE layers
(expert_parallel.py), and here, torch-free for the specs, which parameters are routed experts
and which buffers feed titan-run's expert-load metrics.

A family's MoE layer names its stacked expert weights `w1`, `w2`, `w3` ((experts, out, in),
like nn.Linear's, so a slice on dim 0 is one rank's experts), has the attributes `n_experts`,
`top_k`, `plan`, `ep_group` and `load_groups`, and the buffers `tokens_per_expert` and
`dropped_tokens`; the model lists its MoE layers with `moe_layers()` and marks each block that
holds one with `block.moe`.
"""

from __future__ import annotations

EXPERT_WEIGHTS = ("w1", "w2", "w3")
"""The stacked expert weights of a MoE layer, split on dim 0 over the `ep` mesh dimension."""
BUFFER_METRICS = {"tokens_per_expert": "tokens_per_expert", "dropped_tokens": "dropped_tokens"}


def is_expert_param(fqn: str) -> bool:
    """Whether a parameter is a routed expert's (split over ep, data parallel over the rest)."""
    # The stacked expert weights are the MoE models' only parameters not named "<module>.weight".
    return fqn.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def buffer_metric(fqn: str) -> str | None:
    """The MoE layers' load buffers feed titan-run's per-step expert-load metrics."""
    return BUFFER_METRICS.get(fqn.rsplit(".", 1)[-1])

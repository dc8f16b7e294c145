"""What the mixture-of-experts families (deepseek_v3, qwen3) share: the static-buffer token
dispatch (dispatch.py), the expert-parallel placement of a model's MoE layers
(expert_parallel.py), expert tensor parallelism (expert_tp.py), and here, torch-free for the
specs, which parameters are routed experts, which buffers feed titan-run's expert-load
metrics, and the rules of the expert-TP degree (`--etp`).

A family's MoE layer names its stacked expert weights `w1`, `w2`, `w3` ((experts, out, in),
like nn.Linear's, so a slice on dim 0 is one rank's experts), has the attributes `n_experts`,
`top_k`, `plan`, `ep_group` and `load_groups`, and the buffers `tokens_per_expert` and
`dropped_tokens`, and `tp_group` (set under expert tensor parallelism); the model lists its MoE layers with `moe_layers()` and marks each block that
holds one with `block.moe`.
"""

from __future__ import annotations

from titan.builder.models.spec import require_divides
from titan.runtime.contract.layout import Layout

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


def check_expert_tp(etp: int, layout: Layout, *, moe_hidden: int) -> None:
    """--etp, as torchtitan's expert_tensor_parallel_degree: 1 (each routed expert whole on its
    --ep rank, replicated over tp) or --tp (each routed expert's hidden width split over the tp
    ranks, as a dense feed-forward's is). ValueError names the fix."""
    if etp == 1:
        return
    if layout.tp == 1:
        raise ValueError(f"--etp {etp}: expert tensor parallel splits each routed expert over the --tp ranks, and "
                         f"this layout has none; add --tp {etp} or drop --etp")
    if etp != layout.tp:
        raise ValueError(f"--etp {etp}: expert tensor parallel splits each routed expert over the --tp ranks, so it "
                         f"is 1 or the --tp degree ({layout.tp}); use --etp 1 or --etp {layout.tp}")
    require_divides("etp", etp, {"routed expert hidden width": moe_hidden})


def without_default_etp(values: dict) -> dict:
    """A config's as_dict() with `etp` left out at 1: a build without expert TP keeps the cache
    key, manifest and name it had before the option existed."""
    return {k: v for k, v in values.items() if k != "etp" or v != 1}


def expert_tp_tags(config: dict) -> list[str]:
    """['etp2'] for a config (as_dict()) with expert tensor parallelism; the artifact's name."""
    etp = config.get("etp", 1)
    return [f"etp{etp}"] if etp > 1 else []

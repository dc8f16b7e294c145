"""Model FLOPs utilization for a run's summary: the model's training FLOPs per token (6 per
parameter a token passes through, plus attention's 12 x layers x width x sequence, as
torchtitan counts them) over the GPUs' dense bf16 peak. An estimate for a summary line, from
the artifact's data alone (the runtime never sees model code).

Standard library only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan.runtime.contract.manifest import Manifest
    from titan.runtime.contract.rank_record import ParamSpec

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by the name torch.cuda gives the device.
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12}


def bf16_peak(device_name: str) -> float | None:
    return next((peak for name, peak in BF16_PEAK.items() if name in device_name), None)


def _size(cfg: dict, key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def flops_per_token(manifest: Manifest, params: tuple[ParamSpec, ...]) -> float | None:
    """Training FLOPs per token, or None when the artifact's model config lacks a size the count
    needs (the manifest admits any plain values: a summary line must not trust them). The
    embedding is a lookup (no FLOPs); a routed expert's weights count for the share of experts a
    token goes to (top_k of n_routed_experts)."""
    cfg = manifest.model_config
    experts, top_k = _size(cfg, "n_routed_experts"), _size(cfg, "top_k")
    active = 0.0
    for p in params:
        if p.fqn.startswith("tok_embeddings."):
            continue
        n = math.prod(p.global_shape)
        if experts and top_k and len(p.global_shape) == 3 and p.global_shape[0] == experts:
            n *= top_k / experts
        active += n
    if "qk_rope_head_dim" in cfg:
        heads, nope, rope = (_size(cfg, k) for k in ("n_heads", "qk_nope_head_dim", "qk_rope_head_dim"))
        width = heads * (nope + rope) if heads and nope and rope else None
    else:
        width = _size(cfg, "dim")
    layers = _size(cfg, "n_layers")
    if width is None or layers is None:
        return None
    return 6 * active + 12 * layers * width * manifest.seq_len


def mfu_text(manifest: Manifest, params: tuple[ParamSpec, ...], *, tokens_per_s: float, device_name: str) -> str:
    """'MFU 41% of NVIDIA H100's bf16 peak', or '' when the dtype or the GPU's peak is not known."""
    peak = bf16_peak(device_name)
    if peak is None or manifest.dtype != "bfloat16" or tokens_per_s <= 0:
        return ""
    flops = flops_per_token(manifest, params)
    if flops is None:
        return ""
    mfu = tokens_per_s * flops / (manifest.world_size * peak)
    return f"MFU {100 * mfu:.0f}% of {device_name}'s dense bf16 peak"

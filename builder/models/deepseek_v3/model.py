"""DeepSeek-V3 decoder (multi-head latent attention, dense then mixture-of-experts blocks),
written for tracing like Llama 3: plain PyTorch, attention through the runtime's
device-dispatched ops (SDPA, or FlexAttention with the causal or document mask), RoPE tables and
document ids computed inside forward (no constants in the graph).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan.builder.models.decoder import Decoder, DecoderBlock, RMSNorm, SwiGLU, apply_rope, decoder_loss
from titan.builder.models.deepseek_v3.config import DeepSeekV3Config
from titan.builder.models.deepseek_v3.moe import MoE
from titan.runtime.contract.flex_attention import flex_attention
from titan.runtime.contract.ops import causal_attention


def rope_tables(seq_len: int, cfg: DeepSeekV3Config, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, qk_rope_head_dim // 2), float32, with YaRN's frequency
    correction when rope_factor > 1 (DeepSeek-V3's published 671B model uses factor 40)."""
    dim = cfg.qk_rope_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if cfg.rope_factor > 1.0:
        # Frequencies that turn fewer than beta_slow times over the original context are
        # interpolated (divided by the factor), those that turn more than beta_fast times are
        # kept, with a linear ramp between.
        def correction_dim(rotations: float) -> float:
            turns = cfg.rope_original_seq_len / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(cfg.rope_theta))

        low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1.0 - ramp
        inv_freq = inv_freq / cfg.rope_factor * (1 - keep) + inv_freq * keep
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class MultiHeadLatentAttention(nn.Module):
    """MLA: queries through an optional low-rank bottleneck; keys and values decompressed per
    head from one shared latent of kv_lora_rank dims; RoPE only on qk_rope_head_dim extra
    dims, whose key part is shared by all heads (decoupled RoPE). With the config's attention
    'flex', titan's FlexAttention op, masked to each token's document when forward is given
    `documents` (builder/models/decoder.py's document_ids)."""

    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__()
        self.cfg = cfg
        n_heads, qk_dim = cfg.n_heads, cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * cfg.v_head_dim, cfg.dim, bias=False)
        # Where the rotary key part, shared by all heads, meets the heads: an identity that the
        # tensor-parallel plan hooks (each rank holds some heads, so its gradient is a share).
        self.rope_key = nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if cfg.q_lora_rank else self.wq(x)
        # -1 for the head count: under tensor parallelism each rank holds a slice of the heads.
        q = q.view(bsz, seqlen, -1, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        heads = k_nope.shape[2]
        k_rope = self.rope_key(apply_rope(k_rope[:, :, None, :], cos, sin)).expand(-1, -1, heads, -1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        if cfg.rope_factor > 1.0:
            # YaRN's softmax temperature; the attention op applies qk_head_dim ** -0.5 itself.
            q = q * (cfg.softmax_scale * math.sqrt(cfg.qk_head_dim))
        if cfg.attention == "flex":
            # FlexAttention takes v's head size apart from q's and k's: v goes in as it is.
            out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        else:
            # The SDPA kernels (CPU flash, CUDA flash) need one head size for q, k and v: pad v
            # with zeros to qk_head_dim. Output columns are independent sums over keys, so the
            # padding adds only zero columns, which are cut off again.
            v = F.pad(v, (0, cfg.qk_head_dim - cfg.v_head_dim))
            out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[..., :cfg.v_head_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def transformer_block(cfg: DeepSeekV3Config, layer: int) -> DecoderBlock:
    """The first n_dense_layers blocks have a dense feed-forward, the rest the mixture of experts."""
    moe = layer >= cfg.n_dense_layers
    return DecoderBlock(dim=cfg.dim, norm_eps=cfg.norm_eps, attention=MultiHeadLatentAttention(cfg),
                        feed_forward=MoE(cfg) if moe else SwiGLU(cfg.dim, cfg.dense_hidden), moe=moe)


class DeepSeekV3(Decoder):
    """DeepSeek-V3 (builder/models/decoder.py's Decoder says what its forward returns)."""

    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__(cfg, [transformer_block(cfg, i) for i in range(cfg.n_layers)])

    def rope(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(seq_len, self.cfg, device)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1], tokens.device)
        return decoder_loss(self, tokens, labels, cos, sin)

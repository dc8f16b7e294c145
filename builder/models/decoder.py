"""The pieces the decoder families (llama3, deepseek_v3, qwen3) share: RMSNorm, RoPE on
interleaved pairs, grouped-query attention (with Qwen3's optional per-head norm of queries and
keys), the SwiGLU feed-forward, the pre-norm block, and the forward pass from token embeddings
to this rank's share of the loss. Plain PyTorch, written for tracing: attention goes through the
runtime's device-dispatched ops (SDPA, or FlexAttention with the causal or document mask), RoPE
tables and document ids are computed inside forward (no constants in the graph)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan.runtime.contract.flex_attention import flex_attention
from titan.runtime.contract.ops import causal_attention


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim // 2), float32."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class GroupedQueryAttention(nn.Module):
    """Causal attention with n_kv_heads key/value heads shared by groups of query heads.

    `head_dim` is explicit (Qwen3's is not dim / n_heads). With `qk_norm_eps`, queries and keys
    are RMS-normed per head (one weight of head_dim, shared by every head) before RoPE, as in
    Qwen3; Llama has none. `attention` 'flex' runs titan's FlexAttention op, masked to each
    token's document when forward is given `documents` (see document_ids).
    """

    def __init__(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm_eps: float | None = None,
                 attention: str = "sdpa"):
        super().__init__()
        self.flex = attention == "flex"
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = flex_attention(q, k, v, documents) if self.flex else causal_attention(q, k, v)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): Llama's feed-forward, DeepSeek-V3's dense blocks and each expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + feed_forward(norm(h)). `moe` marks a
    block whose feed-forward is a mixture of experts (builder/models/moe)."""

    def __init__(self, *, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module,
                 moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.moe = moe
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        # `documents` goes by keyword: the tensor-parallel plan prepares attention's three
        # positional inputs and passes keywords through.
        extra = {} if documents is None else {"documents": documents}
        h = x + self.attention(self.attention_norm(x), cos, sin, **extra)
        return h + self.feed_forward(self.ffn_norm(h))


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's document number within its sequence, (batch, seq) int64: the count of
    end-of-document tokens before it, so the separator belongs to the document it ends and a
    sequence that starts inside a document calls that part document 0. Computed on the tokens'
    device inside the step: the boundaries are data, never constants of the graph."""
    ends = (tokens == eos_id).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


def decoder_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """A decoder's forward: embed `tokens`, run each block of `model.layers` as block(h, cos, sin)
    (with documents=document_ids(tokens, eos_id) when the config's mask is 'document'), norm,
    project to logits, and return the summed next-token loss divided by `model.loss_scale`
    (the builder sets it to the global batch's token count, so that the data-parallel ranks'
    outputs sum to the mean loss)."""
    documents = document_ids(tokens, model.cfg.eos_id) if getattr(model.cfg, "mask", "causal") == "document" else None
    h = model.tok_embeddings(tokens)
    for block in model.layers.values():
        h = block(h, cos, sin) if documents is None else block(h, cos, sin, documents=documents)
    logits = model.output(model.norm(h))
    return ScaledTokenLoss(model.loss_scale)(logits, labels)


class ScaledTokenLoss:
    """The summed next-token loss of `logits` against `labels`, divided by `scale`: a decoder's
    loss (scale: the global batch's token count), and a pipeline's last stage's (the same count
    for one micro-batch)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        return loss / self.scale


class Decoder(nn.Module):
    """A decoder family's model: embedding, blocks ("layers.<i>"), final norm and output
    projection, whose forward (each family's: its RoPE tables, then decoder_loss) returns this
    rank's share of the mean next-token loss.

    `loss_scale` (an attribute) divides the summed token loss: the builder sets it to the number
    of tokens in the global batch, so summing every data-parallel rank's output gives the mean
    loss and the gradients (summed by the data-parallel reductions) are those of that mean.
    """

    loss_scale: float = 1.0

    def __init__(self, cfg, blocks: list[nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def rope(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables (cos, sin) of `seq_len` positions, computed inside the forward: the
        whole model's and each pipeline stage's (builder/models/decoder_stage.py). A family with
        another rotary scheme (DeepSeek-V3's YaRN on its rotary dims) overrides it."""
        return rope_tables(seq_len, self.cfg.head_dim, self.cfg.rope_theta, device)

    def moe_layers(self) -> list[nn.Module]:
        """The mixture-of-experts feed-forwards (builder/models/moe), in block order."""
        return [block.feed_forward for block in self.layers.values() if getattr(block, "moe", False)]


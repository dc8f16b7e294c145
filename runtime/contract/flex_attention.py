"""`titan::flex_attention`: FlexAttention's causal and document masks, with the mask as data.

A graph calls `titan::flex_attention(q, k, v, documents)` where `documents` is None (causal) or
each token's document number, (batch, seq) int64, computed inside the step from the batch
(builder/models/attention.py): a token attends to itself and to earlier tokens of its own
document. Nothing about a batch's boundaries is a constant of the graph, so new boundaries at
every step need no rebuild. The mask is built from `documents` inside the kernel, on the
tensors' device, without reading anything back to the host.

Why an op of titan's and not torch's `flex_attention` higher-order op: the op's eager math path
(torch/_higher_order_ops/flex_attention.py, `math_attention` and `sdpa_dense_backward`: torch
2.13, and upstream's current source alike) imports torch._dynamo on every call, which the runtime must not, and the op
carries its mask and score functions as Python callables (subgraphs) that an artifact could only
hold as code. Here the mask is one of two named kinds and its only data a tensor; the kernels
below compute exactly what that math path computes for an identity score_mod (float32 scores,
masked to -inf, logsumexp, softmax in float32, the products in the inputs' dtype; the backward
its formulas, with its base-2 logsumexp), and tests check the forward torch.equal to PyTorch's
own eager flex_attention and the backward to the higher-order op's math backward.
The eager reference (titan-verify) calls this same op, so both run the same kernels.

That is the CPU kernel: it materializes the (batch, heads, seq, seq) scores. On a GPU the op runs
FlexAttention's fused, block-sparse Triton kernels instead (runtime/kernels/flex_kernels.py:
inductor's templates for the higher-order op, compiled and stored as kernel plans like the fusion
regions, the block mask built on the device from `documents` at each call); the eager reference
on a GPU runs those same kernels.
q, k, v are (batch, heads, seq, head_dim) with as many key/value heads as query heads; v's
head_dim may differ from q's and k's (DeepSeek-V3's latent attention: 192 for q and k, 128 for v;
FlexAttention's kernels take the two sizes apart, torch PR 134043), and the output has v's. The
scale is q's head_dim ** -0.5.
"""

from __future__ import annotations

import math

import torch

_lib = torch.library.Library("titan", "FRAGMENT")
_lib.define("flex_attention(Tensor q, Tensor k, Tensor v, Tensor? documents) -> (Tensor, Tensor)")
_lib.define("flex_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor? documents) -> (Tensor, Tensor, Tensor)")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None) -> None:
    """A graph is data: refuse inputs the kernel would silently broadcast or misread."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"flex_attention takes q and k of one (batch, heads, seq, head_dim) shape and v of their "
                         f"batch, heads and seq, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; "
                         "rebuild the artifact")
    if documents is not None and (documents.dtype != torch.int64 or tuple(documents.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"flex_attention's document ids must be int64 of shape (batch, seq) = "
                         f"{(q.shape[0], q.shape[2])}, got {documents.dtype} {tuple(documents.shape)}; rebuild the artifact")


def _check_backward(grad_out, q, k, v, out, lse, documents) -> None:
    _check(q, k, v, documents)
    if grad_out.shape != v.shape or out.shape != v.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"flex_attention_backward takes grad_out and out of v's shape {tuple(v.shape)} and a "
                         f"logsumexp of {tuple(q.shape[:3])}, got {tuple(grad_out.shape)}, {tuple(out.shape)}, "
                         f"{tuple(lse.shape)}; rebuild the artifact")


def attention_mask(documents: torch.Tensor | None, seq: int, device: torch.device) -> torch.Tensor:
    """True where query m may attend to key n: n <= m (causal) and, with `documents`, the same
    document. (seq, seq), or (batch, 1, seq, seq) with documents; built on `device`."""
    pos = torch.arange(seq, device=device)
    causal = pos[:, None] >= pos[None, :]
    if documents is None:
        return causal
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def _filled(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor of `value` made on `device` by a fill kernel: `torch.tensor(value, device=...)`
    copies from the host, which a CUDA graph capture refuses (and which waits on the device)."""
    return torch.full((), value, dtype=dtype, device=device)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled float32 scores, -inf where masked (FlexAttention's math path, working precision
    float32 for 16- and 32-bit inputs)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q.to(torch.float32) @ k.to(torch.float32).transpose(-2, -1)
    scores = (scores * scale).to(torch.float32)
    return torch.where(mask, scores, _filled(-float("inf"), torch.float32, q.device))


def _flex_attention(q, k, v, documents):
    """Returns (out (batch, heads, seq, v's head_dim), contiguous; logsumexp float32 (batch, heads, seq), base 2 as
    the higher-order op returns it)."""
    _check(q, k, v, documents)
    scores = _masked_scores(q, k, attention_mask(documents, q.shape[2], q.device))
    lse = scores.logsumexp(dim=-1)
    # Every query sees at least itself, so no row is fully masked: softmax is the math path's
    # _safe_softmax here.
    probs = torch.softmax(scores, dim=-1)
    return (probs.to(q.dtype) @ v.to(q.dtype)).contiguous(), lse / math.log(2)


def _flex_attention_backward(grad_out, q, k, v, out, lse, documents):
    """Returns (grad_q, grad_k, grad_v), each contiguous, shaped like q, k, v: FlexAttention's math backward
    for an identity score_mod (no gradient flows into the logsumexp)."""
    _check_backward(grad_out, q, k, v, out, lse, documents)
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = attention_mask(documents, q.shape[2], q.device)
    probs = torch.exp(_masked_scores(q, k, mask) - (lse * math.log(2)).unsqueeze(-1))
    grad_v = probs.to(q.dtype).transpose(-2, -1) @ grad_out
    grad_probs = grad_out.to(torch.float32) @ v.to(torch.float32).transpose(-2, -1)
    row = torch.sum(out.to(torch.float32) * grad_out.to(torch.float32), -1, keepdim=True)
    grad_scores = ((probs * (grad_probs - row)) * scale).to(q.dtype)
    grad_scores = torch.where(mask, grad_scores, _filled(0, q.dtype, q.device))
    grad_q = grad_scores @ k
    grad_k = grad_scores.transpose(-2, -1) @ q
    return grad_q.contiguous(), grad_k.contiguous(), grad_v.contiguous()


def _flex_attention_fake(q, k, v, documents):
    _check(q, k, v, documents)
    return q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3], dtype=torch.float32)


def _flex_attention_backward_fake(grad_out, q, k, v, out, lse, documents):
    _check_backward(grad_out, q, k, v, out, lse, documents)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flex_attention_cuda(q, k, v, documents):
    _check(q, k, v, documents)
    from titan.runtime.kernels.flex_kernels import flex_forward
    return flex_forward(q, k, v, documents)


def _flex_attention_backward_cuda(grad_out, q, k, v, out, lse, documents):
    _check_backward(grad_out, q, k, v, out, lse, documents)
    from titan.runtime.kernels.flex_kernels import flex_backward
    return flex_backward(grad_out, q, k, v, out, lse, documents)


_lib.impl("flex_attention", _flex_attention, "CPU")
_lib.impl("flex_attention_backward", _flex_attention_backward, "CPU")
# On GPUs: FlexAttention's fused block-sparse kernels (runtime/kernels/flex_kernels.py).
_lib.impl("flex_attention", _flex_attention_cuda, "CUDA")
_lib.impl("flex_attention_backward", _flex_attention_backward_cuda, "CUDA")
torch.library.register_fake("titan::flex_attention", _flex_attention_fake, lib=_lib)
torch.library.register_fake("titan::flex_attention_backward", _flex_attention_backward_fake, lib=_lib)


def _setup_context(ctx, inputs, output):
    q, k, v, documents = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, documents)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, documents = ctx.saved_tensors
    return (*torch.ops.titan.flex_attention_backward(grad_out, q, k, v, out, lse, documents), None)


torch.library.register_autograd("titan::flex_attention", _backward, setup_context=_setup_context, lib=_lib)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    """Causal attention (documents None) or document-masked causal attention."""
    return torch.ops.titan.flex_attention(q, k, v, documents)[0]

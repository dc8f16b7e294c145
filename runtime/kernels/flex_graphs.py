"""The graphs inductor compiles into FlexAttention's fused kernels for titan's two masks.

Each is torch's own FlexAttention higher-order op (forward, or its backward) traced by make_fx
over explicit inputs: q, k, v (the backward adds out, logsumexp, grad_out), the document ids (the
document mask's one buffer), and the eight block-mask tensors (runtime/kernels/flex_block_mask.py).
Inductor lowers the op to its Triton templates (the forward kernel; the backward's kernel and
the small reduction before it), which is what titan-build --kernels records as kernel plans and
the runtime launches (runtime/kernels/flex_kernels.py).

The score function is the identity and the scale head_dim ** -0.5, as titan's op computes
(runtime/contract/flex_attention.py); the mask functions are the op's two masks, written once here.

Imported only where these kernels are compiled (with inductor, on the GPU or for a named GPU):
tracing the higher-order op imports torch._dynamo.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from titan.runtime.kernels.flex_block_mask import BLOCK

KERNEL_OPTIONS = {
    # Triton's templates, not the CuTe flash backend (a separate install).
    "BACKEND": "TRITON",
    # What torch's public flex_attention sets by default (nn/attention/flex_attention.py,
    # _apply_kernel_options), for a forward whose logsumexp a backward reads.
    "PRESCALE_QK": False,
    "ROWS_GUARANTEED_SAFE": False,
    "BLOCKS_ARE_CONTIGUOUS": False,
    "WRITE_DQ": True,
    "OUTPUT_LOGSUMEXP": True,
    "OUTPUT_MAX": False,
}


def _identity(score, b, h, m, n):
    return score


def _causal(b, h, m, n):
    return n <= m


def _document(b, h, m, n, documents):
    return (n <= m) & (documents[b, m] == documents[b, n])


def _block_mask(seq: int, blocks: tuple, documents: bool) -> tuple:
    return (seq, seq, *blocks, BLOCK, BLOCK, _document if documents else _causal)


def forward_graph(examples: list[torch.Tensor], *, documents: bool) -> fx.GraphModule:
    """(q, k, v[, documents], *blocks) -> (out, logsumexp); `examples` (fake) fix the layouts."""
    from torch._higher_order_ops.flex_attention import flex_attention
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(q, k, v, *rest):
        docs, blocks = (rest[:1], rest[1:]) if documents else ((), rest)
        out, lse, _ = flex_attention(q, k, v, _identity, _block_mask(q.shape[2], blocks, documents),
                                     q.shape[-1] ** -0.5, dict(KERNEL_OPTIONS), (), docs)
        return out, lse

    return make_fx(forward)(*examples)


def backward_graph(examples: list[torch.Tensor], *, documents: bool) -> fx.GraphModule:
    """(q, k, v, out, logsumexp, grad_out[, documents], *blocks) -> (grad_q, grad_k, grad_v);
    no gradient flows into the logsumexp."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph, flex_attention_backward
    from torch.fx.experimental.proxy_tensor import make_fx

    # The score function's joint graph, traced on the CPU (its graph names no device; traced
    # on the CUDA examples' fake device it asks CUDA for a context).
    index_values = (torch.zeros((), requires_grad=True),) + tuple(torch.zeros((), dtype=torch.int) for _ in range(4))
    score_graph, joint_graph = create_fw_bw_graph(_identity, index_values, ())

    def backward(q, k, v, out, lse, grad_out, *rest):
        docs, blocks = (rest[:1], rest[1:]) if documents else ((), rest)
        grad_q, grad_k, grad_v, _ = flex_attention_backward(
            q, k, v, out, lse, grad_out, None, score_graph, joint_graph,
            _block_mask(q.shape[2], blocks, documents), q.shape[-1] ** -0.5, dict(KERNEL_OPTIONS), (), docs)
        return grad_q, grad_k, grad_v

    return make_fx(backward)(*examples)

"""Device-dispatched operators that graphs may call besides aten / c10d ops.

Attention is the one op whose aten form depends on the device (CPU flash, CUDA flash for
16-bit inputs, CUDA memory-efficient for float32). Graphs are traced on a CPU build for any
device, so they call `titan::attention` / `titan::attention_backward`, and these pick the
kernel where the graph runs. The eager reference calls the same ops, so both run the same
kernels. Causal, no dropout, default scale; q, k, v are (batch, heads, seq, head_dim) with as
many key/value heads as query heads.
"""

from __future__ import annotations

import torch

# Defined through torch.library.Library rather than torch.library.custom_op: the latter wraps
# every kernel in a dynamo guard that imports torch._dynamo, which the runtime must not.
_lib = torch.library.Library("titan", "DEF")
_lib.define("attention(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
_lib.define("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse)"
            " -> (Tensor, Tensor, Tensor)")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, logsumexp)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out, lse
    if q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
        return res[0], res[1]
    res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    return res[0], res[1]


def _attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (grad_q, grad_k, grad_v)."""
    grad_out = grad_out.contiguous()
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True)
        return dq, dk, dv
    seq = q.shape[2]
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    if q.dtype in (torch.float16, torch.bfloat16):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, seq, seq, 0.0, True, zero, zero)
        return dq, dk, dv
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, zero, zero, 0.0, [True, True, True, False], True)
    return dq, dk, dv


for _key in ("CPU", "CUDA"):
    _lib.impl("attention", _attention, _key)
    _lib.impl("attention_backward", _attention_backward, _key)


# Fake (shape) kernels: the same dispatch, on fake tensors, so aten's own meta kernels give the
# exact output layouts of the kernel the device will run (compilers check them).
torch.library.register_fake("titan::attention", _attention, lib=_lib)
torch.library.register_fake("titan::attention_backward", _attention_backward, lib=_lib)


def _setup_context(ctx, inputs, output):
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return torch.ops.titan.attention_backward(grad_out, q, k, v, out, lse)


torch.library.register_autograd("titan::attention", _backward, setup_context=_setup_context, lib=_lib)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.titan.attention(q, k, v)[0]


# The other titan:: op, the mixture-of-experts grouped GEMM, has its own module; importing this
# one registers every op a graph may call.
import titan.runtime.grouped_mm  # noqa: E402,F401

"""Device-dispatched operators that graphs may call besides aten / c10d ops.

Attention is the one op whose aten form depends on the device (CPU flash, CUDA flash for
16-bit inputs, CUDA memory-efficient for float32). Graphs are traced on a CPU build for any
device, so they call `titan::attention` / `titan::attention_backward`, and these pick the
kernel where the graph runs. The eager reference calls the same ops, so both run the same
kernels. Causal, no dropout, default scale; q, k, v are (batch, heads, seq, head_dim) with as
many key/value heads as query heads.

On Hopper and newer, 16-bit attention runs cuDNN's fused kernels where torch allows them: on
an H100 (torch 2.11, Llama-3 1B, seq 8192) they take 40 ms of a step where flash-attention 2
takes 61.5 ms. Their outputs are copied, where they differ, into the layouts the flash kernel
returns, so the graphs' compiled regions see the strides they were compiled for either way.
"""

from __future__ import annotations

import torch

# Defined through torch.library.Library rather than torch.library.custom_op: the latter wraps
# every kernel in a dynamo guard that imports torch._dynamo, which the runtime must not.
_lib = torch.library.Library("titan", "DEF")
_lib.define("attention(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
_lib.define("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse)"
            " -> (Tensor, Tensor, Tensor)")


def _in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t with the shape, strides and dtype of `like` (a meta tensor): a view where the memory
    layout already agrees (strides of size-1 dimensions aside), else a copy."""
    if t.shape != like.shape:
        t = t.reshape(like.shape)  # logsumexp: (b, h, s, 1) <-> (b, h, s), a view
    if t.dtype == like.dtype and all(a == b for a, b, n in zip(t.stride(), like.stride(), t.shape) if n > 1):
        return t if t.stride() == like.stride() else t.as_strided(like.shape, like.stride())
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=t.device).copy_(t)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _use_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """cuDNN attention: 16-bit CUDA inputs on Hopper or newer, where torch's own SDPA would
    allow it. Never under deterministic algorithms: torch counts cuDNN attention as
    nondeterministic (sdp_utils.cpp, check_cudnn_deterministic) and flash-attention 2 then runs
    its deterministic backward. The choice depends only on the device, dtypes, shapes and that
    mode, so the eager reference and an artifact make the same one, and a backward its forward's."""
    if q.dtype not in (torch.float16, torch.bfloat16) or torch.are_deterministic_algorithms_enabled():
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"):
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False)
    return torch.backends.cuda.can_use_cudnn_attention(params, False)


def _cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's (out, logsumexp) in flash-attention 2's layouts: out like q, logsumexp float32
    (b, h, s) contiguous (cuDNN's is (b, h, s, 1) in torch 2.13)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[:2]
    _CUDNN_LSE_LAYOUTS[_layout_key(q)] = (tuple(lse.shape), tuple(lse.stride()))
    b, h, s, _ = q.shape
    return _in_layout(out, _meta_like(q)), _in_layout(lse, torch.empty((b, h, s), device="meta"))


# The logsumexp layout cuDNN's forward returned, by the query's layout: the backward hands the
# logsumexp back in it. Asking aten's meta kernel instead (as a backward without its forward in
# this process must) imports sympy (its empty_like goes through torch._refs and symbolic_shapes):
# 3.7 s of a rank's start on an H100 (issue 30).
_CUDNN_LSE_LAYOUTS: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _layout_key(q: torch.Tensor) -> tuple:
    return (tuple(q.shape), tuple(q.stride()), q.dtype, q.device)


def _cudnn_lse_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A meta tensor in the layout of the logsumexp cuDNN's forward returns for q, k, v."""
    found = _CUDNN_LSE_LAYOUTS.get(_layout_key(q))
    if found is None:
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            _meta_like(q), _meta_like(k), _meta_like(v), None, True, 0.0, True, False)[1]
    shape, stride = found
    return torch.empty_strided(shape, stride, dtype=torch.float32, device="meta")


def _cudnn_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients like q, k, v (as flash-attention 2 returns them), from what _cudnn_attention returned."""
    # The logsumexp back in the layout cuDNN's forward made.
    cudnn_lse = _cudnn_lse_layout(q, k, v)
    # cuDNN reads the output's gradient with the output's strides, as torch's own SDPA hands it.
    grad_out = _in_layout(grad_out, _meta_like(out))
    zero = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's seed and offset: unused
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, _in_layout(lse, cudnn_lse), zero, zero, None, None, None,
        q.shape[2], k.shape[2], 0.0, True)
    return tuple(_in_layout(g, _meta_like(t)) for g, t in zip(grads, (q, k, v)))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, logsumexp)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out, lse
    if _use_cudnn(q, k, v):
        return _cudnn_attention(q, k, v)
    if q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
        return res[0], res[1]
    res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    return res[0], res[1]


def _attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (grad_q, grad_k, grad_v)."""
    if q.device.type == "cuda" and _use_cudnn(q, k, v):
        return _cudnn_attention_backward(grad_out, q, k, v, out, lse)
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
import titan.runtime.contract.grouped_mm  # noqa: E402,F401
import titan.runtime.contract.flex_attention  # noqa: E402,F401

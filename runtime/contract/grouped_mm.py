"""`titan::grouped_mm`: the grouped GEMM that mixture-of-experts graphs call, with the group
boundaries on the device.

aten's `_grouped_mm` computes it (on CPU for float32 and bfloat16 when strides are multiples of
16 bytes; on CUDA for bfloat16), but its fake kernel accepts bfloat16 only, so a float32 model
could not be traced. This op gives it a dtype-neutral fake kernel and defines its gradient with
itself, so traced graphs and the eager reference run the same kernels. It also pins down what
aten leaves undefined: rows past the last offset, and groups without rows, come out zero (aten
leaves uninitialized memory there), so nothing downstream ever sees garbage.

Two forms, as aten's:
- a (M, K) @ b (G, K, N) -> (M, N): rows offs[g-1]:offs[g] of a are multiplied by b[g];
- a (K, M) @ b (M, N) -> (G, K, N): group g reduces over columns of a / rows of b offs[g-1]:offs[g]
  (the weight gradient of the first form).
offs is int32 (G,), the running ends of the groups.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("titan", "FRAGMENT")
_lib.define("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor")


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch._grouped_mm(a, b, offs=offs)
    if b.dim() == 3:
        unused = torch.arange(out.shape[0], device=out.device) >= offs[-1]
        return out.masked_fill(unused[:, None], 0).contiguous()
    empty = offs.diff(prepend=offs.new_zeros(1)) == 0
    return out.masked_fill(empty[:, None, None], 0).contiguous()


def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


for _key in ("CPU", "CUDA"):
    _lib.impl("grouped_mm", _grouped_mm, _key)
torch.library.register_fake("titan::grouped_mm", _grouped_mm_fake, lib=_lib)


def _setup_context(ctx, inputs, output):
    a, b, offs = inputs
    assert b.dim() == 3, "only the (M, K) @ (G, K, N) form is differentiable"
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad_out):
    a, b, offs = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_a = torch.ops.titan.grouped_mm(grad_out, b.transpose(-2, -1), offs)
    grad_b = torch.ops.titan.grouped_mm(a.t(), grad_out, offs)
    return grad_a, grad_b, None


torch.library.register_autograd("titan::grouped_mm", _backward, setup_context=_setup_context, lib=_lib)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch.ops.titan.grouped_mm(a, b, offs)

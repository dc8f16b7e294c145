"""AdamW in one GPU kernel per parameter, bit for bit the op-by-op update.

runtime/optim.AdamW (and torch.optim.AdamW(foreach=False)) runs eight kernels per parameter:
mul_, lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_, about 20 passes over fp32 memory per
step. This kernel reads the parameter, its gradient and both moments once and writes three of
them back: 7 passes (42.5 -> 14.8 ms per step for one 8B dp-shard=4 rank on an H200).

It rounds as ATen's CUDA kernels do, op for op. Measured (benchmarks/adamw_exact.py), not
assumed:
- every intermediate is rounded to float32 where eager stores it; the compiler may not
  contract anything on its own (enable_fp_fusion=False);
- lerp_ (weight < 0.5), addcmul_ and addcdiv_ are one fused multiply-add each, as the CUDA
  compiler contracts them: fma(w, end - self, self), fma(value, t1 * t2, self) and
  fma(value, t1 / t2, self); division and square root are IEEE-rounded;
- a tensor divided by a Python float is multiplied by the float32 rounding of the reciprocal
  computed in double: x * f32(1 / c). (Neither x / f32(c) nor x * (1 / f32(c)) matches.)

Imports triton on first use, on a GPU only. The state (exp_avg, exp_avg_sq, steps) is
runtime/optim.AdamW's, so checkpoints are interchangeable.
"""

from __future__ import annotations

import importlib.util

import torch

from titan.runtime.optim import AdamW

BLOCK = 2048

_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, decay, w1, beta2, alpha2, inv_bc2, eps, neg_step,
                     BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p = p * decay                                   # p.mul_(1 - lr * weight_decay)
        m = tl.fma(w1, g - m, m)                        # exp_avg.lerp_(grad, 1 - beta1)
        v = tl.fma(alpha2, g * g, v * beta2)            # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        d = tl.sqrt_rn(v) * inv_bc2 + eps               # (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p = tl.fma(neg_step, tl.div_rn(m, d), p)        # p.addcdiv_(exp_avg, denom, value=-step_size)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

    return adamw_kernel


def _f32(x: float) -> float:
    """x rounded to float32, as ATen hands a Python scalar to a float32 kernel."""
    return torch.tensor(x, dtype=torch.float32).item()


def fused_adamw_available(params: list[torch.Tensor]) -> bool:
    """Whether FusedAdamW takes `params`: triton is installed and each is contiguous fp32 on a GPU."""
    return importlib.util.find_spec("triton") is not None and all(
        p.device.type == "cuda" and p.dtype == torch.float32 and p.is_contiguous() for p in params)


class FusedAdamW(AdamW):
    def __init__(self, params: list[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, schedule=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, schedule=schedule)
        if not fused_adamw_available(self.params):
            raise ValueError("the one-kernel AdamW takes contiguous float32 CUDA parameters and needs triton; "
                             "run with --no-fused-adamw")

    @torch.no_grad()
    def step(self) -> None:
        global _kernel
        if _kernel is None:
            _kernel = _build_kernel()
        step_size, bias_correction2_sqrt = self.next_step()
        beta1, beta2 = self.betas
        scalars = (_f32(1 - self.lr * self.weight_decay), _f32(1 - beta1), _f32(beta2), _f32(1 - beta2),
                   _f32(1 / bias_correction2_sqrt), _f32(self.eps), _f32(-step_size))
        for p, exp_avg, exp_avg_sq in zip(self.params, self.exp_avg, self.exp_avg_sq):
            grad = p.grad
            assert grad is not None, "every parameter gets a gradient from the backward graph"
            if grad.dtype != torch.float32 or not grad.is_contiguous():
                grad = grad.float().contiguous()
            n = p.numel()
            _kernel[((n + BLOCK - 1) // BLOCK,)](p, grad, exp_avg, exp_avg_sq, n, *scalars, BLOCK=BLOCK,
                                                 num_warps=8, enable_fp_fusion=False)

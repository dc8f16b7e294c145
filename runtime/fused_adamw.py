"""AdamW in one GPU kernel per parameter, bit for bit the op-by-op update.

runtime/optim.AdamW (and torch.optim.AdamW(foreach=False)) runs eight kernels per parameter:
mul_, lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_, about 20 passes over fp32 memory per
step. This kernel reads the parameter, its gradient and both moments once and writes three of
them back: 7 passes (42.5 -> 14.8 ms per step for one 8B dp-shard=4 rank on an H200). Where the
forward takes the parameter's compute-dtype copy (runtime/param_copies.py), it writes that too.

It rounds as ATen's CUDA kernels do, op for op. Measured (benchmarks/adamw_exact.py), not
assumed:
- every intermediate is rounded to float32 where eager stores it; the compiler may not
  contract anything on its own (enable_fp_fusion=False);
- lerp_ (weight < 0.5), addcmul_ and addcdiv_ are one fused multiply-add each, as the CUDA
  compiler contracts them: fma(w, end - self, self), fma(value, t1 * t2, self) and
  fma(value, t1 / t2, self); division and square root are IEEE-rounded;
- a tensor divided by a Python float is multiplied by the float32 rounding of the reciprocal
  computed in double: x * f32(1 / c). (Neither x / f32(c) nor x * (1 / f32(c)) matches.)

Imports triton on first use, on a GPU only; `start_compiling` starts that as the first
step begins, so that the step does not wait for Triton's compile. The state (exp_avg,
exp_avg_sq, steps) is runtime/optim.AdamW's, so checkpoints are interchangeable.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Iterable

import torch

from titan.runtime.optim import AdamW
from titan.runtime.param_copies import gradients

BLOCK = 1024
NUM_WARPS = 16
"""The launch shape (benchmarks/gpu/adamw_tune.py times the candidates; any gives the same bits)."""

_kernel = None
_compiling: threading.Thread | None = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, scalars_ptr, scale_ptr, SCALE_GRAD: tl.constexpr,
                     WRITE_COPY: tl.constexpr, BLOCK: tl.constexpr):
        # The step's scalars come from device memory, not the launch: a captured launch then
        # reads each step's learning rate and bias corrections (see FusedAdamW.prepare).
        decay = tl.load(scalars_ptr + 0)
        w1 = tl.load(scalars_ptr + 1)
        beta2 = tl.load(scalars_ptr + 2)
        alpha2 = tl.load(scalars_ptr + 3)
        inv_bc2 = tl.load(scalars_ptr + 4)
        eps = tl.load(scalars_ptr + 5)
        neg_step = tl.load(scalars_ptr + 6)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)  # a copy's bf16 gradient: its exact upcast
        if SCALE_GRAD:
            g = g * tl.load(scale_ptr)                  # torch._foreach_mul_(grads, clip_coef), rounded as stored
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
        if WRITE_COPY:  # the forward's copy: copy_'s rounding (to nearest even)
            tl.store(c_ptr + offs, p.to(c_ptr.dtype.element_ty), mask=mask)

    return adamw_kernel


def _the_kernel():
    """The kernel, once the background compile (if one was started) has ended."""
    global _kernel, _compiling
    if _compiling is not None:
        _compiling.join()
        _compiling = None
    if _kernel is None:
        _kernel = _build_kernel()
    return _kernel


def _variants(params: Iterable[torch.Tensor], copies: Iterable[torch.Tensor | None],
              low_grads: Iterable[bool]) -> set[tuple]:
    """(element count, copy dtype, gradient dtype) of one parameter per compiled variant these
    need: Triton specializes an integer argument on being a multiple of 16 and on needing 64
    bits, and the kernel on the copy's dtype (None: no copy) and the gradient's (the copy's for
    a captured step's `low_grads`, float32 for the eager steps before it and otherwise)."""
    variants = {}
    for p, copy, low in zip(params, copies, low_grads):
        n, dtype = p.numel(), None if copy is None else copy.dtype
        for grad_dtype in (torch.float32, dtype) if low else (torch.float32,):
            variants[(n % 16 == 0, n >= 2**31, dtype, grad_dtype)] = (n, dtype, grad_dtype)
    return set(variants.values())


def start_compiling(device: torch.device, params: list[torch.Tensor], copies: list[torch.Tensor | None] | None,
                    low_grads: list[bool] | None = None, *, clipped: bool) -> None:
    """Compile the kernel's variants for `params` (their `copies`, and the copies' gradients
    where `low_grads`: runtime/param_copies.py) on a thread: Triton's
    import, compile and launcher build (1.4 s on an empty cache, 0.7 s warm, on an H200) then
    overlap the first step's forward and backward instead of adding to it. (Started at the
    rank's start instead, it slowed the program's loading, which is Python, by as much as it
    saved.) `clipped`: the update may also scale gradients (a second variant).

    The thread makes no CUDA call a capture on another thread forbids (it loads no module: the
    first launch does, in the eager warm-up before any capture). Any failure leaves the compile
    to the first launch, as without this."""
    global _compiling
    variants = _variants(params, copies or [None] * len(params), low_grads or [False] * len(params))
    if _compiling is not None or _kernel is not None or not variants or importlib.util.find_spec("triton") is None:
        return

    def compile_variants() -> None:
        global _kernel
        try:
            from triton.runtime import driver

            torch.cuda.set_device(device)  # Triton compiles for, and caches under, the current device
            kernel = _build_kernel()
            f32 = torch.float32  # Triton's warm-up takes a dtype for a pointer: aligned, as allocations are
            for n, copy_dtype, grad_dtype in sorted(variants, key=str):
                for scale in (False, True) if clipped else (False,):
                    compiled = kernel.warmup(f32, grad_dtype, f32, f32, copy_dtype or f32, n, f32, f32,
                                             SCALE_GRAD=scale, WRITE_COPY=copy_dtype is not None, BLOCK=BLOCK,
                                             num_warps=NUM_WARPS, enable_fp_fusion=False, grid=(1,))
                    driver.active.launcher_cls(compiled.src, compiled.metadata)  # its launcher built and cached
            _kernel = kernel
        except Exception:  # noqa: BLE001 - the first launch compiles, and reports, instead
            pass

    _compiling = threading.Thread(target=compile_variants, name="titan-adamw-compile", daemon=True)
    _compiling.start()


def fused_adamw_available(params: list[torch.Tensor]) -> bool:
    """Whether FusedAdamW takes `params`: triton is installed and each is contiguous fp32 on a GPU."""
    return importlib.util.find_spec("triton") is not None and all(
        p.device.type == "cuda" and p.dtype == torch.float32 and p.is_contiguous() for p in params)


class FusedAdamW(AdamW):
    """One kernel per parameter. A step is `prepare()` (host: the step's scalars, copied to the
    device without waiting for it) then `launch()` (device only: what a CUDA graph captures)."""

    def __init__(self, params: list[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, schedule=None, copies: list[torch.Tensor | None] | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, schedule=schedule,
                         copies=copies)
        if not fused_adamw_available(self.params):
            raise ValueError("the one-kernel AdamW takes contiguous float32 CUDA parameters and needs triton; "
                             "run with --no-fused-adamw")
        self.scalars = torch.zeros(7, dtype=torch.float32, device=self.params[0].device)

    def prepare(self) -> None:
        """Count the step and put its scalars in `self.scalars`, each the float32 rounding of the
        Python value ATen would hand its kernel. The copy comes from freshly pinned memory, so it
        neither waits for the device nor races the previous step's copy."""
        step_size, bias_correction2_sqrt = self.next_step()
        beta1, beta2 = self.betas
        values = (1 - self.lr * self.weight_decay, 1 - beta1, beta2, 1 - beta2, 1 / bias_correction2_sqrt,
                  self.eps, -step_size)
        self.scalars.copy_(torch.tensor(values, dtype=torch.float32).pin_memory(), non_blocking=True)

    @torch.no_grad()
    def launch(self, grad_scale: torch.Tensor | None = None) -> None:
        """The update with the prepared scalars; `grad_scale` (a float32 device scalar, the clip
        coefficient) multiplies each gradient as it is read, as torch._foreach_mul_ of the fp32
        gradients before the step would: it saves a pass over every gradient. A copy's gradient
        a captured step left (runtime/param_copies.py) is read in its dtype and upcast first."""
        kernel = _the_kernel()
        scale = grad_scale if grad_scale is not None else self.scalars  # an unread pointer
        grads = gradients(self.params, self.copies)
        for p, grad, exp_avg, exp_avg_sq, copy in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.copies):
            assert grad is not None, "every parameter gets a gradient from the backward graph"
            readable = (torch.float32,) if copy is None else (torch.float32, copy.dtype)
            if grad.dtype not in readable or not grad.is_contiguous():
                grad = grad.float().contiguous()
            n = p.numel()
            kernel[((n + BLOCK - 1) // BLOCK,)](p, grad, exp_avg, exp_avg_sq, p if copy is None else copy, n,
                                                self.scalars, scale, SCALE_GRAD=grad_scale is not None,
                                                WRITE_COPY=copy is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
                                                enable_fp_fusion=False)

    @torch.no_grad()
    def step(self) -> None:
        self.prepare()
        self.launch()

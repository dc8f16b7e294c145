"""Which kernel titan::attention picks on this GPU for Llama-3 1B's attention shapes, and the
forward + backward time of one layer's attention with it and with flash-attention 2.

    python3 benchmarks/attention_kernels.py          # on a CUDA host
"""

from __future__ import annotations

import torch

from titan.runtime.contract import ops


def _step_ms(fwd, bwd, q, k, v, grad, iters: int = 20) -> float:
    for _ in range(3):
        out, lse = fwd(q, k, v)
        bwd(grad, q, k, v, out, lse)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        out, lse = fwd(q, k, v)
        bwd(grad, q, k, v, out, lse)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _flash(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[:2]


def _flash_backward(grad, q, k, v, out, lse):
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad.contiguous(), q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, True, zero, zero)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for seq in (2048, 8192):
        q, k, v, grad = (torch.randn(1, seq, 32, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                         for _ in range(4))
        kernel = "cudnn" if ops._use_cudnn(q, k, v) else "flash"
        titan_ms = _step_ms(torch.ops.titan.attention, torch.ops.titan.attention_backward, q, k, v, grad)
        flash_ms = _step_ms(_flash, _flash_backward, q, k, v, grad)
        print(f"seq {seq}: titan::attention picks {kernel}: {titan_ms:.2f} ms fwd+bwd per layer; "
              f"flash-attention 2: {flash_ms:.2f} ms")


if __name__ == "__main__":
    main()

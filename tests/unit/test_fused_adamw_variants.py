"""Which variants of the one-kernel AdamW a rank compiles in the background at its start
(runtime/fused_adamw.py; the compile itself is checked on a GPU in tests/gpu/test_gpu.py)."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from titan.runtime import fused_adamw


def _meta(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device="meta")


def test_one_variant_per_element_count_class_copy_dtype_and_gradient_dtype():
    # Multiples of 16, others, and counts that need 64 bits: Triton compiles each class once,
    # and once more for each dtype of the parameters' copies (runtime/param_copies.py) and of
    # their gradients (a copy's bf16 gradient in a captured step, float32 in an eager one).
    counts = [2048, 16, 37_000, 7, 3 << 31, 2048 * 128_256]
    variants = fused_adamw._variants([_meta(n) for n in counts], [None] * len(counts), [False] * len(counts))
    assert {(n % 16 == 0, n >= 2**31, dtype, grad) for n, dtype, grad in variants} == {
        (True, False, None, torch.float32), (False, False, None, torch.float32), (True, True, None, torch.float32)}
    copies = [_meta(2048, torch.bfloat16), None, _meta(37_000, torch.bfloat16), _meta(7, torch.float16), None, None]
    low = [True, False, False, True, False, False]
    variants = fused_adamw._variants([_meta(n) for n in counts], copies, low)
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert {(n % 16 == 0, n >= 2**31, dtype, grad) for n, dtype, grad in variants} == {
        (True, False, bf16, fp32), (True, False, bf16, bf16), (True, False, None, fp32), (False, False, bf16, fp32),
        (False, False, fp16, fp32), (False, False, fp16, fp16), (True, True, None, fp32)}
    assert fused_adamw._variants([], [], []) == set()


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="checks a host without triton")
def test_without_triton_no_compile_starts(monkeypatch):
    monkeypatch.setattr(fused_adamw, "_compiling", None)
    fused_adamw.start_compiling(torch.device("cuda", 0), [_meta(2048)], None, None, clipped=True)
    assert fused_adamw._compiling is None
    assert not any(t.name == "titan-adamw-compile" for t in threading.enumerate())

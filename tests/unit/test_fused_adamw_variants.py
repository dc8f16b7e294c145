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


def test_one_variant_per_element_count_class_and_copy_dtype():
    # Multiples of 16, others, and counts that need 64 bits: Triton compiles each class once,
    # and once more for each dtype of the parameters' copies (runtime/param_copies.py).
    counts = [2048, 16, 37_000, 7, 3 << 31, 2048 * 128_256]
    variants = fused_adamw._variants([_meta(n) for n in counts], [None] * len(counts))
    assert {(n % 16 == 0, n >= 2**31, dtype) for n, dtype in variants} == {
        (True, False, None), (False, False, None), (True, True, None)}
    copies = [_meta(2048, torch.bfloat16), None, _meta(37_000, torch.bfloat16), _meta(7, torch.float16), None, None]
    variants = fused_adamw._variants([_meta(n) for n in counts], copies)
    assert {(n % 16 == 0, n >= 2**31, dtype) for n, dtype in variants} == {
        (True, False, torch.bfloat16), (True, False, None), (False, False, torch.bfloat16),
        (False, False, torch.float16), (True, True, None)}
    assert fused_adamw._variants([], []) == set()


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="checks a host without triton")
def test_without_triton_no_compile_starts(monkeypatch):
    monkeypatch.setattr(fused_adamw, "_compiling", None)
    fused_adamw.start_compiling(torch.device("cuda", 0), [_meta(2048)], None, clipped=True)
    assert fused_adamw._compiling is None
    assert not any(t.name == "titan-adamw-compile" for t in threading.enumerate())

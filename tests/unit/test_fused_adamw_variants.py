"""Which variants of the one-kernel AdamW a rank compiles in the background at its start
(runtime/fused_adamw.py; the compile itself is checked on a GPU in tests/gpu/test_gpu.py)."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from titan.runtime import fused_adamw


def test_one_variant_per_element_count_class():
    # Multiples of 16, others, and counts that need 64 bits: Triton compiles each class once.
    variants = fused_adamw._variants([2048, 16, 37_000, 7, 3 << 31, 2048 * 128_256])
    assert len(variants) == 3
    assert {(n % 16 == 0, n >= 2**31) for n in variants} == {(True, False), (False, False), (True, True)}
    assert fused_adamw._variants([]) == set()


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="checks a host without triton")
def test_without_triton_no_compile_starts(monkeypatch):
    monkeypatch.setattr(fused_adamw, "_compiling", None)
    fused_adamw.start_compiling(torch.device("cuda", 0), [2048], clipped=True)
    assert fused_adamw._compiling is None
    assert not any(t.name == "titan-adamw-compile" for t in threading.enumerate())

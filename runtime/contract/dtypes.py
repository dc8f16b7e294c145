"""The dtype names an artifact, a checkpoint or a graph may carry: one allow-list, checked where a
name is read, so that no stored string ever reaches getattr(torch, ...) (issue 29: a node's dtype
"load" did). Torch-free; `torch_dtype` imports torch when called."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
               "complex64")
"""Every dtype a titan graph's values may have."""
PARAM_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""What a parameter (or its master copy) may be stored as."""


def is_dtype_name(name, allowed: tuple[str, ...] = DTYPE_NAMES) -> bool:
    return isinstance(name, str) and name in allowed


def torch_dtype(name: str):
    """The torch dtype of a name already checked against DTYPE_NAMES."""
    import torch

    assert name in DTYPE_NAMES, name
    return getattr(torch, name)

"""The checks the contract's records run as they are read: an artifact is untrusted input (its
hashes can be consistent and its content still crafted), so every assumption the runtime makes
is checked before anything executes. Each failure is one line that says how to fix it."""

from __future__ import annotations

import re

from titan.runtime.contract.graph_doc import MAX_ELEMENTS

_REL_PATH = re.compile(r"(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+")


class ArtifactError(ValueError):
    """The artifact is missing, corrupt, or does not fit this process; the message says how to fix it."""


class ArtifactCheckError(ArtifactError):
    """A structural check failed; the artifact was not built by titan-build or was altered."""


def fail(where: str, what: str):
    raise ArtifactCheckError(f"{where}: {what}; rebuild the artifact with titan-build")


def check_int(v, where: str, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        fail(where, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def check_shape(v, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 8:
        fail(where, f"expected a shape, got {v!r}")
    total = 1
    for d in v:
        total *= check_int(d, where, 1)
    check_int(total, where, 1)
    return tuple(v)


def check_str(v, where: str, what: str) -> str:
    """A short plain string (names, versions, dtypes): what the tools print and compare."""
    if not isinstance(v, str) or len(v) > 256:
        fail(where, f"{what} {str(v)[:80]!r} is not a string")
    return v


def check_rel_path(rel, where: str) -> str:
    if not isinstance(rel, str) or not _REL_PATH.fullmatch(rel) or ".." in rel.split("/"):
        fail(where, f"{rel!r} is not a plain relative path inside the artifact")
    return rel

"""Which eager model titan-verify compares an artifact with: the dropless model, unless the
artifact drops MoE assignments past a capacity (titan-build --moe-drop) and the user said that
this is what to compare (titan-verify --moe-drop). No torch import: the launcher checks it
before it imports torch."""

from __future__ import annotations

from titan.runtime.contract.manifest import Manifest


def drop_capacity(manifest: Manifest) -> float | None:
    """The capacity of a drop-and-pad artifact, which its eager reference drops at too; None for
    every other artifact (a bounded dispatch that redoes overflows is compared with dropless eager)."""
    capacity = manifest.moe_capacity
    return capacity.factor if capacity is not None and capacity.drop else None


def check_drop_label(manifest: Manifest, accept_drop: bool) -> None:
    """titan-verify's reference is the model without changed numerics: a drop-and-pad artifact
    is compared only when the user says so (--moe-drop), against eager PyTorch dropping alike."""
    drop = drop_capacity(manifest)
    if drop is not None and not accept_drop:
        raise ValueError(f"this artifact drops the MoE assignments past capacity {drop:g} (titan-build --moe-drop), "
                         "which changes numerics: the dropless model cannot match it; pass --moe-drop to compare it with "
                         "eager PyTorch dropping at the same capacity")
    if drop is None and accept_drop:
        raise ValueError("--moe-drop: this artifact does not drop MoE assignments (it was built without --moe-drop); "
                         "leave --moe-drop out")

"""Whether a parallel layout (runtime/contract/layout.py) fits a model: the checks every family shares,
then the family's own (ModelSpec.check_layout, in the model's folder)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan.runtime.contract.layout import MESH_DIMS, Layout

if TYPE_CHECKING:
    from titan.builder.models.spec import ModelConfig, ModelSpec


def check_layout(family: ModelSpec, cfg: ModelConfig, layout: Layout) -> None:
    """Raise ValueError, naming the reason and the fix, when the layout does not fit the model."""
    for name in MESH_DIMS:
        if getattr(layout, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(layout, name)}")
    if layout.ep > 1 and family.expert_param is None:
        raise ValueError(f"--ep {layout.ep}: {family.name} has no routed experts to split; drop --ep (or build a "
                         "mixture-of-experts model such as --model deepseek_v3)")
    family.check_layout(cfg, layout)

"""The model seam: what the build pipeline, its passes and the tools ask of a model family.

A family lives in its own folder (builder/models/<name>/) and exports one ModelSpec; the
registry (builder/models/__init__.py) lists them by name. Nothing outside the folder knows a
module name: trace, the eager reference, the passes and the tools ask the spec. The runtime
never imports model code; what it needs of a model travels in the artifact as data (the
manifest's `hf_checkpoint` record, for example).

Importing a spec imports no torch (titan-build's cache-hit path reads flavors and shapes):
`build` and `tp_plan` import the model code when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    from torch import nn

    from titan.runtime.contract.hf_record import HFRecord
    from titan.runtime.contract.layout import Layout


class ModelConfig(Protocol):
    """A family's shapes: a frozen dataclass whose as_dict() goes into the manifest and the cache key."""

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    name: str
    """Family name (titan-build --model)."""
    flavors: Mapping[str, ModelConfig]
    """Sizes of the family (titan-build --flavor), e.g. debug, 8B."""
    default_flavor: str
    """The flavor titan-build picks without --flavor (left out of artifact names)."""
    config_from_dict: Callable[[dict], ModelConfig]
    """The manifest's model_config back into the config type."""
    build: Callable[[ModelConfig], nn.Module]
    """The module, created on the current default device. forward(tokens, labels) returns this
    rank's share of the mean loss: the summed token loss divided by the module's `loss_scale`
    attribute (the builder sets it to the global batch's token count)."""
    init_specs: Callable[[ModelConfig], dict[str, dict]]
    """How each parameter is initialized, by fully qualified name (runtime/init.py draws them)."""
    tp_plan: Callable[[nn.Module], dict]
    """The tensor-parallel plan for parallelize_module: module path -> parallel style."""
    check_layout: Callable[[ModelConfig, Layout], None]
    """Raise ValueError, naming the reason, when a layout does not divide the model."""
    block_of: Callable[[str], str]
    """Module path -> the block it belongs to ('layers.3.attention.wq' -> 'layers.3'): FSDP
    buckets and fuse_blocks' regions follow blocks."""
    ac_block: Callable[[str], int | None]
    """Module path -> the number of the block that activation checkpointing recomputes as one
    unit, or None for modules outside blocks (embedding, final norm, output, loss)."""
    region_kind: Callable[[str], str | None]
    """Module path -> fuse_regions' region kind (e.g. 'rms_norm'), or None: not fused."""
    hf_checkpoint: Callable[[ModelConfig, list[str]], HFRecord] | None = None
    """The Hugging Face checkpoint record for the given parameters (names, row permutations,
    expected config.json values), written into the manifest for --init-from-hf and
    titan-export; None when the family has no Hugging Face counterpart."""

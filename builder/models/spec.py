"""The model seam: what the build pipeline, its passes and the tools ask of a model family.

A family lives in its own folder (builder/models/<name>/) and exports one ModelSpec; the
registry (builder/models/__init__.py) lists them by name. Nothing outside the folder knows a
module name: trace, the eager reference, the passes and the tools ask the spec. The runtime
never imports model code; what it needs of a model travels in the artifact as data (the
manifest's `hf_checkpoint` record, for example).

Importing a spec imports no torch (titan-build's cache-hit path reads flavors and shapes):
`build` and `tp_plan` import the model code when called (`lazy`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol

if TYPE_CHECKING:
    from torch import nn

    from titan.builder.spec.stage_split import StageCosts
    from titan.runtime.contract.hf_record import HFRecord
    from titan.runtime.contract.layout import Layout


class ModelConfig(Protocol):
    """A family's shapes: a frozen dataclass whose as_dict() goes into the manifest and the cache key."""

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Flavors(Mapping[str, ModelConfig]):
    """A family's sizes by name (titan-build --flavor) and the one picked without --flavor."""

    shapes: Mapping[str, ModelConfig]
    """Flavor name -> its config (e.g. debug, 8B)."""
    default: str
    """The flavor titan-build picks without --flavor (left out of artifact names)."""

    def __getitem__(self, name: str) -> ModelConfig:
        return self.shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def lazy(target: str) -> Callable:
    """The function or class 'module:name' (as graph passes name theirs), imported when called:
    a spec names its torch code without importing it."""
    def call(*args, **kwargs):
        module, name = target.split(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)
    call.__qualname__ = target
    return call


def layer_block(module: str) -> str:
    """Module path -> its block, for families whose blocks are `layers.<n>`:
    'layers.3.attention.wq' -> 'layers.3'; 'output' -> 'output'."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def layer_number(module: str) -> int | None:
    """Module path -> the number of its `layers.<n>` block (3 for 'layers.3.attention'), else None."""
    parts = module.split(".")
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 else None


@dataclass(kw_only=True, frozen=True)
class RankPlace:
    """Where a rank sits, for a model that needs more than its parameters laid out."""

    layout: Layout
    """The parallel layout."""
    mesh: Any
    """The device mesh (None on a single rank)."""
    batch_size: int
    """Sequences per data-parallel rank."""
    seq_len: int
    """Tokens per sequence (under tp, each rank's modules between the sequence-parallel
    regions see seq_len / tp of them)."""
    capacity_factor: float | None = None
    """A mixture of experts' dispatch capacity factor (builder/models/moe/dispatch.py); None:
    dropless."""


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    name: str
    """Family name (titan-build --model)."""
    flavors: Flavors
    """Sizes of the family (titan-build --flavor), e.g. debug, 8B, and the default one."""
    build: Callable[[ModelConfig], nn.Module]
    """The module, created on the current default device. forward(tokens, labels) returns this
    rank's share of the mean loss: the summed token loss divided by the module's `loss_scale`
    attribute (the builder sets it to the global batch's token count). Modules may share a
    parameter (tied embeddings): it stays one parameter, named by its first module, in every
    layout whose plan splits both uses alike (builder/trace/parallelize.py)."""
    init_specs: Callable[[ModelConfig], dict[str, dict]]
    """How each parameter is initialized, by fully qualified name (runtime/init.py draws them)."""
    tp_plan: Callable[[nn.Module], dict]
    """The tensor-parallel plan for parallelize_module: module path -> parallel style."""
    check_shape: Callable[[ModelConfig], None]
    """The family's rules for a config's own dimensions (heads divide the width, ...): raise
    ValueError naming the rule and the fix. Checked for shapes set on top of a flavor
    (builder/models/shape.py); the built-in flavors pass them."""
    check_layout: Callable[[ModelConfig, Layout], None]
    """The model's own layout checks: raise ValueError, naming the reason and the fix, when a
    layout does not divide the model (builder/spec/layout.py runs the checks common to every family
    first)."""
    region_kind: Callable[[str], str | None]
    """Module path -> fuse_regions' region kind (e.g. 'rms_norm'), or None: not fused."""
    block_of: Callable[[str], str] = layer_block
    """Module path -> the block it belongs to ('layers.3.attention.wq' -> 'layers.3'): FSDP
    buckets and fuse_blocks' regions follow blocks."""
    ac_block: Callable[[str], int | None] = layer_number
    """Module path -> the number of the block that activation checkpointing recomputes as one
    unit, or None for modules outside blocks (embedding, final norm, output, loss)."""
    expert_param: Callable[[str], bool] | None = None
    """Parameter name -> whether it is a routed expert's, split on dim 0 over the `ep` mesh
    dimension (builder/trace/parallelize.py); None: the family has no experts and builds with --ep 1.
    A family with dense and MoE flavors (Qwen3) refuses --ep for its dense ones in check_layout."""
    has_experts: Callable[[ModelConfig], bool] = lambda cfg: False
    """Whether a config has routed experts (what --moe-capacity applies to)."""
    place_rank: Callable[[nn.Module, RankPlace], dict | None] = lambda model, place: None
    """After parallelize, before the trace (and in the eager reference): give the model what
    depends on the rank's place (a mixture of experts' dispatch plan and process groups).
    Returns a JSON record of what was decided, the same on every rank (the rank metadata's
    `model_plan`, shown by titan-show), or None: nothing to decide."""
    buffer_metric: Callable[[str], str | None] = lambda fqn: None
    """Buffer name -> the per-step metric titan-run reads from it after each step
    ('tokens_per_expert' or 'dropped_tokens', runtime/buffer_state.py), or None."""
    exact_fusion: bool = True
    """Whether fuse_exact is a default pass: its regions measured bitwise against eager on a GPU
    for this family's graphs (False: the family's GPU runs stay on eager's kernels by default)."""
    leading_layers: Callable[[ModelConfig], int] = lambda cfg: 0
    """How many first blocks differ from the repeated block that follows them (e.g. dense
    feed-forward blocks before the experts): a deep model's shallow traces keep all of them and
    add 3-5 repeated blocks (builder/program/deep.py)."""
    stage_costs: Callable[[ModelConfig, int], StageCosts] | None = None
    """(config, sequence length) -> the training FLOPs per token and the parameters of each
    block, of the embedding and of the output (builder/spec/stage_split.py): what a pipeline's
    stage split balances and --pp-plan reports. None: the family builds with --pp 1."""
    hf_checkpoint: Callable[[ModelConfig, list[str]], HFRecord] | None = None
    """The Hugging Face checkpoint record for the given parameters (names, row permutations,
    expected config.json values), written into the manifest for --init-from-hf and
    titan-export; None when the family has no Hugging Face counterpart."""

    @property
    def default_flavor(self) -> str:
        return self.flavors.default

    def config_from_dict(self, values: dict) -> ModelConfig:
        """The manifest's model_config back into the family's config type."""
        return type(self.flavors[self.flavors.default])(**values)


def require_divides(flag: str, degree: int, sizes: dict[str, int]) -> None:
    """Raise ValueError unless the `--flag` degree divides each named size of the model."""
    for what, size in sizes.items():
        if size % degree:
            raise ValueError(f"--{flag} {degree} does not divide the {what} ({size}); pick a --{flag} that divides it")

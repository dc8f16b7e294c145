"""What one titan-build makes, validated: the model and flavor, the layout, the batch shape,
dtype, activation checkpointing and passes (a BuildSpec), and the artifact name it gets.
Every user input is checked here, before anything is traced; ValueError names the fix."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from titan.builder.passes.checkpointing import AC_POLICIES
from titan.builder.spec.layout import check_layout
from titan.builder.models import model_spec
from titan.builder.models.attention import attention_overrides, attention_tags
from titan.builder.models.moe import expert_tp_tags
from titan.builder.models.shape import apply_shape, shape_tags
from titan.builder.models.spec import ModelConfig, ModelSpec
from titan.builder.passes.registry import check_passes, default_passes
from titan.builder.spec.pipeline_spec import PipelineSpec, make_pipeline
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.rank_record import StagePlace

# Batch shape defaults: small for the CPU-sized flavors, Llama-3 pretraining shape otherwise.
DEBUG_SHAPE = (2, 128)
PARTITIONERS = ("min_cut", "default")
# Tokens per rank and step: 8B's pretraining batch (16 x 8192) is 2^17; 2^22 is far past what
# any device holds, and keeps every graph's element counts realistic.
MAX_TOKENS_PER_RANK = 2**22


@dataclass(kw_only=True, frozen=True)
class BuildSpec:
    model: str
    """Model family (builder/models registry)."""
    flavor: str
    """Size within the family."""
    layout: Layout
    """Parallel layout."""
    batch_size: int
    """Sequences per data-parallel rank per step."""
    seq_len: int
    """Tokens per sequence."""
    partitioner: str = "min_cut"
    """Forward/backward partitioner."""
    dtype: str = "float32"
    """Compute dtype (parameters and optimizer state stay float32)."""
    ac: str = "none"
    """Activation checkpointing policy (builder/passes/checkpointing.py)."""
    graph_passes: tuple[str, ...]
    """Passes applied after partitioning, in order (builder/passes/registry.py)."""
    n_layers: int | None = None
    """The flavor with this many layers instead of its own (tests of deep models at debug
    widths); part of the model config, so of the cache key."""
    shape: tuple[tuple[str, int | float], ...] = ()
    """Dimensions set on top of the flavor (field, value), checked by make_spec
    (builder/models/shape.py); part of the model config and of the artifact's name."""
    pipeline: PipelineSpec | None = None
    """With --pp > 1: the schedule, micro-batches and stage split (builder/spec/pipeline_spec.py)."""
    stage: StagePlace | None = None
    """Set on the build of one stage of a pipeline (stage_builds): what is traced is that stage,
    on the layout without pp (a stage's graphs hold only its own ranks' collectives and do not
    depend on the schedule: every schedule of the same split reuses them from the cache)."""
    attention: tuple[tuple[str, Any], ...] = ()
    """The attention choice's config fields that differ from SDPA causal (field, value),
    checked by builder/models/attention.py; part of the model config and of the artifact's name."""
    moe_capacity: float | None = None
    """Capacity factor of the MoE dispatch buffers (builder/models/moe/dispatch.py); None:
    dropless buffers (the default)."""
    moe_drop: bool = False
    """With moe_capacity: assignments past a buffer's capacity are dropped (numerics change).
    Without: the artifact also carries the dropless program, which redoes an overflowing step."""
    etp: int = 1
    """Expert tensor-parallel degree: 1, or the layout's tp (each routed expert's hidden width
    split over tp: builder/models/moe/expert_tp.py); part of the model config (its `etp`), so of
    the cache key and the artifact's name."""

    @property
    def moe_redo(self) -> bool:
        """Whether the artifact carries the dropless program to redo overflowing steps."""
        return self.moe_capacity is not None and not self.moe_drop

    def stage_builds(self) -> list[BuildSpec]:
        """A pipeline build's stages, each a build of its own (traced and cached alone)."""
        return [replace(self, layout=replace(self.layout, pp=1), pipeline=None, stage=stage)
                for stage in self.pipeline.stages()]

    def dropless(self) -> BuildSpec:
        """The same build with dropless dispatch buffers: the default build, its cache key included."""
        return replace(self, moe_capacity=None, moe_drop=False)

    @property
    def passes(self) -> tuple[str, ...]:
        return (f"partition:{self.partitioner}", *self.graph_passes)

    @property
    def model_spec(self) -> ModelSpec:
        return model_spec(self.model)

    @property
    def cfg(self) -> ModelConfig:
        cfg = replace(self.model_spec.flavors[self.flavor], **dict(self.shape), **dict(self.attention),
                      **({"etp": self.etp} if self.etp > 1 else {}))
        return cfg if self.n_layers is None else replace(cfg, n_layers=self.n_layers)

    @property
    def name(self) -> str:
        """The default artifact directory's name: model, flavor and layout, then each choice that
        shapes the graphs and differs from its default (`llama3-debug-tp2-s256-bf16-ac-full`), so
        that two different builds never share a default directory."""
        flavor = "" if self.flavor == self.model_spec.default_flavor else f"-{self.flavor}"
        return "-".join([f"{self.model}{flavor}", *shape_tags(dict(self.shape)), self.layout.tag(),
                         *attention_tags(self.cfg.as_dict()), *expert_tp_tags(self.cfg.as_dict()),
                         *(self.pipeline.tags() if self.pipeline else []),
                         *non_default_choices(flavor=self.flavor, mesh=self.layout.mesh_shape(),
                                              batch_size=self.batch_size, seq_len=self.seq_len, dtype=self.dtype,
                                              ac=self.ac, passes=self.passes,
                                              exact_fusion=self.model_spec.exact_fusion),
                         *capacity_tags(self.moe_capacity, self.moe_drop)])


def capacity_tags(factor: float | None, drop: bool) -> list[str]:
    """`cap1.25` (bounded, redone dropless on overflow) or `cap1.25-drop`; nothing when dropless."""
    if factor is None:
        return []
    return [f"cap{factor:g}" + ("-drop" if drop else "")]


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16"}


def is_debug_flavor(flavor: str) -> bool:
    """The CPU-sized flavors: `debug`, and `debug-<variant>` where a family has several (Qwen3's
    dense `debug` and `debug-moe`)."""
    return flavor == "debug" or flavor.startswith("debug-")


def _default_shape(flavor: str) -> tuple[int, int]:
    return DEBUG_SHAPE if is_debug_flavor(flavor) else (1, 8192)


def _default_dtype(flavor: str) -> str:
    # bf16 is the GPU default; the CPU-sized debug flavors default to fp32.
    return "float32" if is_debug_flavor(flavor) else "bfloat16"


def non_default_choices(*, flavor: str, mesh: list, batch_size: int, seq_len: int, dtype: str, ac: str,
                        passes: list[str] | tuple[str, ...], exact_fusion: bool = True) -> list[str]:
    """Short tags for each graph-shaping choice that differs from its default, in a fixed order:
    b4, s256, bf16, ac-full, default-partition, fuse-blocks, passes-<digest of the list>. Names
    artifacts and tells builds apart in `titan-cache ls`. `passes` as in BuildSpec.passes."""
    tags = []
    default_b, default_s = _default_shape(flavor)
    if batch_size != default_b:
        tags.append(f"b{batch_size}")
    if seq_len != default_s:
        tags.append(f"s{seq_len}")
    if dtype != _default_dtype(flavor):
        tags.append(DTYPE_TAGS.get(dtype, dtype))
    if ac != "none":
        tags.append(f"ac-{ac}")
    partitioner, *graph_passes = passes
    if partitioner != "partition:min_cut":
        tags.append(f"{partitioner.split(':')[-1]}-partition")
    defaults = default_passes({name: size for name, size in mesh}, exact_fusion=exact_fusion)
    fuse = next((p for p in graph_passes if p in ("fuse_regions", "fuse_blocks")), None)
    if fuse is not None:
        tags.append(fuse.replace("_", "-"))
        defaults = tuple(p for p in defaults if p != "fuse_exact") + (fuse,)
    if tuple(graph_passes) != defaults:
        tags.append("passes-" + hashlib.sha256(",".join(graph_passes).encode()).hexdigest()[:8])
    return tags


def make_spec(*, model: str, flavor: str | None, tp: int, dp_shard: int, dp_replicate: int, ep: int = 1,
              batch_size: int | None, seq_len: int | None, partitioner: str = "min_cut",
              dtype: str | None = None, passes: tuple[str, ...] | None = None, ac: str = "none",
              fuse: str | None = None, shape: Mapping[str, Any] | None = None, attention: str = "sdpa",
              mask: str = "causal", eos_id: int | None = None, moe_capacity: float | None = None,
              moe_drop: bool = False, etp: int = 1, pp: int = 1, microbatches: int | None = None, pp_schedule: str | None = None,
              pp_split: str | None = None, pp_stages_per_rank: int | None = None) -> BuildSpec:
    """Validate user input into a BuildSpec; ValueError names what is wrong and how to fix it.
    `shape`: dimensions of the flavor's config to set (field -> value, builder/models/shape.py);
    `pp` and the pipeline options: builder/spec/pipeline_spec.py."""
    family = model_spec(model)
    flavor = flavor or family.default_flavor
    if flavor not in family.flavors:
        raise ValueError(f"unknown flavor {flavor!r} for {model}; available: {', '.join(family.flavors)}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; available: {', '.join(PARTITIONERS)}")
    layout = Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, tp=tp)
    shaped = apply_shape(family, family.flavors[flavor], shape or {})
    if etp != 1:
        if etp < 1 or not family.has_experts(shaped):
            raise ValueError(f"--etp {etp}: " + ("the degree must be >= 1" if etp < 1 else
                             f"this {family.name} flavor has no routed experts to split; drop --etp or build a "
                             "mixture-of-experts flavor"))
        shaped = replace(shaped, etp=etp)
    check_layout(family, shaped, layout)
    chosen = attention_overrides(shaped, model=model, attention=attention, mask=mask, eos_id=eos_id)
    default_b, default_s = _default_shape(flavor)
    batch_size = default_b if batch_size is None else batch_size
    seq_len = default_s if seq_len is None else seq_len
    if batch_size < 1 or seq_len < 2:
        raise ValueError("--batch-size must be >= 1 and --seq-len >= 2")
    if batch_size * seq_len > MAX_TOKENS_PER_RANK:
        raise ValueError(f"--batch-size {batch_size} x --seq-len {seq_len} is {batch_size * seq_len:,} tokens per rank, "
                         f"more than {MAX_TOKENS_PER_RANK:,}; use a smaller batch or more data-parallel ranks")
    if seq_len % tp:
        raise ValueError(f"--seq-len {seq_len} must be divisible by --tp {tp} (sequence parallel shards it)")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}; use bf16 or fp32")
    dtype = DTYPES[dtype] if dtype else _default_dtype(flavor)
    if ac not in AC_POLICIES:
        raise ValueError(f"unknown --ac {ac!r}; use one of {', '.join(AC_POLICIES)}")
    sizes = dict(layout.mesh_shape())
    passes = default_passes(sizes, exact_fusion=family.exact_fusion) if passes is None else tuple(passes)
    if fuse is not None:
        if fuse not in ("regions", "blocks"):
            raise ValueError(f"--fuse {fuse!r}: use regions or blocks")
        # --fuse's regions take in the exact ones.
        passes = tuple(p for p in passes if p != "fuse_exact") + (f"fuse_{fuse}",)
    check_passes(passes, sizes)
    check_capacity(family, shaped, moe_capacity, moe_drop)
    pipeline = make_pipeline(model=model, cfg=shaped, layout=layout, seq_len=seq_len, schedule=pp_schedule,
                             microbatches=microbatches, split=pp_split, stages_per_rank=pp_stages_per_rank)
    return BuildSpec(model=model, flavor=flavor, layout=layout, batch_size=batch_size, seq_len=seq_len,
                     partitioner=partitioner, dtype=dtype, graph_passes=passes, ac=ac, pipeline=pipeline,
                     shape=tuple((name, getattr(shaped, name)) for name in sorted(shape or {})),
                     attention=tuple(sorted(chosen.items())),
                     # One spelling of a factor (2 from a config file, 2.0 from the flag): one cache key.
                     moe_capacity=None if moe_capacity is None else float(moe_capacity), moe_drop=moe_drop,
                     etp=etp)


def check_capacity(family: ModelSpec, cfg: ModelConfig, factor: float | None, drop: bool) -> None:
    """--moe-capacity needs routed experts and a positive finite factor; --moe-drop needs a capacity."""
    if drop and factor is None:
        raise ValueError("--moe-drop drops the assignments past a capacity: give the capacity too, e.g. "
                         "--moe-capacity 1.25 --moe-drop")
    if factor is None:
        return
    if not family.has_experts(cfg):
        raise ValueError(f"--moe-capacity: this {family.name} flavor has no routed experts to dispatch; drop "
                         "--moe-capacity or build a mixture-of-experts flavor")
    if not 0 < factor < math.inf:
        raise ValueError(f"--moe-capacity {factor}: the capacity factor must be a positive number, e.g. 1.25")

"""Qwen3, dense (0.6B to 32B shapes) and with a mixture of experts (30B-A3B, 235B-A22B shapes):
shapes (config.py), module code (model.py, moe.py), parameter init (init.py), tensor-parallel plan
(tp_plan.py), the layouts it allows (layout_fit.py), fusion region kinds (regions.py) and
transformers' names (hf_names.py), behind one ModelSpec. The blocks are builder/models/decoder's,
the token dispatch and the expert layout builder/models/moe's. Importing this imports no torch.
"""

from __future__ import annotations

from titan.builder.models.moe import buffer_metric, is_expert_param
from titan.builder.models.qwen3.config import FLAVORS, check_shape, stage_costs
from titan.builder.models.qwen3.hf_names import hf_checkpoint
from titan.builder.models.qwen3.init import init_specs
from titan.builder.models.qwen3.layout_fit import check_layout
from titan.builder.models.qwen3.regions import region_kind
from titan.builder.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    name="qwen3",
    flavors=FLAVORS,
    build=lazy("titan.builder.models.qwen3.model:Qwen3"),
    tp_plan=lazy("titan.builder.models.qwen3.tp_plan:tp_plan"),
    init_specs=init_specs,
    check_layout=check_layout,
    region_kind=region_kind,
    # Dense flavors have no routed experts: check_layout refuses --ep for them.
    expert_param=is_expert_param,
    has_experts=lambda cfg: cfg.moe,
    place_rank=lambda model, place: (lazy("titan.builder.models.moe.expert_parallel:place_rank")(model, place)
                                     if model.cfg.moe else None),
    buffer_metric=buffer_metric,
    leading_layers=lambda cfg: cfg.leading_layers,
    # Not measured on a GPU yet: default runs stay on eager's kernels (--fuse opts in).
    exact_fusion=False,
    hf_checkpoint=hf_checkpoint,
    check_shape=check_shape,
    stage_costs=stage_costs,
)

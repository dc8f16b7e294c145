"""Llama 3 (GQA, RoPE, SwiGLU, RMSNorm): shapes (config.py), module code (model.py), parameter init (init.py),
tensor-parallel plan (tp_plan.py), the layouts it allows (layout_fit.py), fusion region kinds
(regions.py) and the Hugging Face checkpoint record (hf_checkpoint.py), behind one ModelSpec.
Importing this imports no torch."""

from __future__ import annotations

from titan.builder.models.llama3.config import FLAVORS, check_shape
from titan.builder.models.llama3.hf_checkpoint import hf_checkpoint
from titan.builder.models.llama3.init import init_specs
from titan.builder.models.llama3.layout_fit import check_layout
from titan.builder.models.llama3.regions import region_kind
from titan.builder.models.spec import ModelSpec, lazy
from titan.builder.spec.stage_split import dense_decoder_costs

SPEC = ModelSpec(
    name="llama3",
    flavors=FLAVORS,
    build=lazy("titan.builder.models.llama3.model:Llama3"),
    tp_plan=lazy("titan.builder.models.llama3.tp_plan:tp_plan"),
    init_specs=init_specs,
    check_shape=check_shape,
    check_layout=check_layout,
    region_kind=region_kind,
    hf_checkpoint=hf_checkpoint,
    stage_costs=dense_decoder_costs,
)

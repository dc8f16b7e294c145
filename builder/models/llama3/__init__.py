"""Llama 3 (GQA, RoPE, SwiGLU, RMSNorm): shapes (config.py), module code (model.py), parameter init (init.py),
tensor-parallel plan (tp_plan.py), module naming for the passes (naming.py) and the Hugging Face
checkpoint record (hf_checkpoint.py), behind one ModelSpec. Importing this imports no torch."""

from __future__ import annotations

from titan.builder.layout import check_layout
from titan.builder.models.llama3 import naming
from titan.builder.models.llama3.config import DEFAULT_FLAVOR, FLAVORS, LlamaConfig
from titan.builder.models.llama3.hf_checkpoint import hf_checkpoint
from titan.builder.models.llama3.init import init_specs
from titan.builder.models.spec import ModelSpec


def _build(cfg: LlamaConfig):
    from titan.builder.models.llama3.model import Llama3
    return Llama3(cfg)


def _tp_plan(model) -> dict:
    from titan.builder.models.llama3.tp_plan import tp_plan
    return tp_plan(model)


SPEC = ModelSpec(
    name="llama3",
    flavors=FLAVORS,
    default_flavor=DEFAULT_FLAVOR,
    config_from_dict=lambda d: LlamaConfig(**d),
    build=_build,
    init_specs=init_specs,
    tp_plan=_tp_plan,
    check_layout=check_layout,
    block_of=naming.block_of,
    ac_block=naming.ac_block,
    region_kind=naming.region_kind,
    hf_checkpoint=hf_checkpoint,
)

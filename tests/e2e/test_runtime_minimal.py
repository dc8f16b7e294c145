"""The runtime stays minimal: training from an artifact imports neither builder/model code nor
torch._dynamo / torch._inductor, also when it writes TensorBoard scalars, loads Hugging Face
weights, checkpoints and resumes (torch.distributed.checkpoint is imported only then)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from titan.runtime.run_config import RunConfig
from titan.runtime.train import rank_main
code = rank_main(sys.argv[1], RunConfig(quiet=True, **eval(sys.argv[2])))
bad = sorted(m for m in sys.modules if m.startswith(("titan.builder", "torch._dynamo", "torch._inductor")))
print("BAD", bad)
print("DCP", "torch.distributed.checkpoint" in sys.modules)
print("TENSORBOARD", "torch.utils.tensorboard" in sys.modules)
sys.exit(code)
"""


def _probe(art, options: str):
    r = subprocess.run([sys.executable, "-c", PROBE, str(art), options], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "BAD []" in r.stdout, r.stdout
    return r.stdout


def test_training_imports_no_builder_or_compiler(debug_artifact):
    out = _probe(debug_artifact(), "dict(steps=2)")
    assert "DCP False" in out, "a run without checkpoints must not import torch.distributed.checkpoint"
    assert "TENSORBOARD False" in out


def test_flex_attention_with_the_document_mask_imports_no_builder_or_compiler(debug_artifact):
    """PyTorch's own flex_attention path imports torch._dynamo on every call; titan's op must not."""
    _probe(debug_artifact(extra=("--attention", "flex", "--mask", "document", "--eos-id", "7")), "dict(steps=2)")


def test_tensorboard_scalars_import_no_builder_or_compiler(debug_artifact, tmp_path):
    pytest.importorskip("tensorboard")
    out = _probe(debug_artifact(), f"dict(steps=2, tensorboard={str(tmp_path / 'tb')!r})")
    assert "TENSORBOARD True" in out


def test_hf_init_checkpoint_and_resume_import_no_builder_or_compiler(debug_artifact, tmp_path):
    pytest.importorskip("transformers")
    from hf_llama import save_hf_model

    hf = tmp_path / "hf"
    save_hf_model(hf)
    art, ckpt = debug_artifact(), tmp_path / "ckpt"
    assert "DCP True" in _probe(art, f"dict(steps=1, init_from_hf={str(hf)!r}, checkpoint_dir={str(ckpt)!r})")
    _probe(art, f"dict(steps=2, resume=True, checkpoint_dir={str(ckpt)!r})")
    assert (ckpt / "step-00000002" / "titan.json").is_file()

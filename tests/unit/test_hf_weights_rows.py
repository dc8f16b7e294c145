"""Hugging Face Llama weights read in process as --init-from-hf reads them: a shard that cuts a
head still gets the right rows of the un-permuted tensor. (Training from them, titan-export and
bad checkpoints: e2e/test_hf_weights.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import param_spec
from hf_llama import hf_dir  # noqa: F401 (a fixture)


@pytest.mark.parametrize("slices", [[[0, 8, 3]], [[0, 2, 1], [0, 4, 2]], [[1, 2, 1], [0, 16, 5]], [[0, 4, 1]],
                                    [[0, 3, 1]], [[0, 3, 2]], [[1, 2, 1], [0, 5, 4]], [[0, 160, 130]]])
def test_shards_that_cut_heads_read_the_right_rows(slices, hf_dir):
    """A shard may start or end inside a head (FSDP cuts dim 0 after tp, unevenly where it does
    not divide): its rows are still the right ones of the un-permuted tensor, padded as the
    seeded init pads them."""
    from titan.builder.models import model_spec
    from titan.runtime.hf_weights import HFCheckpoint, titan_rows_from_hf
    from titan.runtime.contract.shard_tensors import shard_of

    llama3 = model_spec("llama3")
    cfg = llama3.flavors["debug"]
    ckpt = HFCheckpoint(hf_dir, record=llama3.hf_checkpoint(cfg, list(llama3.init_specs(cfg))))
    full_hf = load_file(hf_dir / "model.safetensors")
    for fqn, name, rows in (("layers.1.attention.wq.weight", "model.layers.1.self_attn.q_proj.weight", 256),
                            ("layers.0.attention.wk.weight", "model.layers.0.self_attn.k_proj.weight", 128)):
        full = full_hf[name].unflatten(0, (-1, 32))[:, titan_rows_from_hf(32)].flatten(0, 1)
        param = param_spec(fqn, [rows, 256], slices)
        assert torch.equal(ckpt.read_shard(param, device=torch.device("cpu")), shard_of(full, slices)), (fqn, slices)
    ckpt.close()

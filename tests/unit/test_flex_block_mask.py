"""The block mask FlexAttention's GPU kernels read, built from document ids on the device
(runtime/kernels/flex_block_mask.py), against the one torch's create_block_mask makes from the
same mask function by evaluating it at every position; and what the flex kernels are keyed by
(runtime/kernels/flex_kernels.py). The kernels themselves run on GPUs only: tests/gpu."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from titan.builder.models.decoder import document_ids
from titan.runtime.kernels.flex_block_mask import BLOCK, block_mask_tensors
from titan.runtime.kernels.flex_kernels import BACKWARD, FORWARD, call_layouts, documents_in, flex_key

NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
         "full_q_num_blocks", "full_q_indices")
EOS = 3


def _torch_block_mask(documents: torch.Tensor | None, batch: int, seq: int):
    if documents is None:
        def mask(b, h, m, n):
            return n <= m
    else:
        def mask(b, h, m, n):
            return (n <= m) & (documents[b, m] == documents[b, n])
    return create_block_mask(mask, batch if documents is not None else batch, None, seq, seq, device="cpu",
                             BLOCK_SIZE=BLOCK)


def _documents(batch: int, seq: int, *, every: int, seed: int) -> torch.Tensor:
    """Document ids as the model computes them, from tokens with separators about every `every`."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 100, (batch, seq), generator=g)
    tokens[torch.rand(batch, seq, generator=g) < 1.0 / every] = EOS
    return document_ids(tokens, EOS)


@pytest.mark.parametrize("every", [40, 200, 1000, 10**9])
def test_document_block_mask_is_create_block_masks(every):
    """Short documents (many partial tiles), long ones (full tiles), one per sequence (as causal)."""
    batch, seq = 3, 8 * BLOCK
    documents = _documents(batch, seq, every=every, seed=every)
    ours = block_mask_tensors(documents, batch=batch, seq=seq, device=torch.device("cpu"))
    theirs = _torch_block_mask(documents, batch, seq)
    for name, tensor in zip(NAMES, ours):
        assert torch.equal(tensor, getattr(theirs, name)), name


def test_causal_block_mask_is_create_block_masks():
    batch, seq = 2, 6 * BLOCK
    ours = block_mask_tensors(None, batch=batch, seq=seq, device=torch.device("cpu"))
    theirs = _torch_block_mask(None, 1, seq)
    for name, tensor in zip(NAMES, ours):
        assert torch.equal(tensor, getattr(theirs, name).expand_as(tensor)), name


def test_document_tiles_skip_other_documents():
    """Two documents of exactly four tiles each: the second's query tiles visit none of the
    first's key tiles, and every key tile before the diagonal within a document is full."""
    seq = 8 * BLOCK
    documents = (torch.arange(seq) >= 4 * BLOCK).long()[None]
    kv_num, kv_idx, full_num, full_idx = block_mask_tensors(documents, batch=1, seq=seq, device=torch.device("cpu"))[:4]
    assert kv_num.flatten().tolist() == [1] * 8  # the diagonal alone is partial
    assert full_num.flatten().tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert full_idx[0, 0, 6, :2].tolist() == [4, 5]


def test_flex_kernel_keys_name_every_layout_and_the_mask():
    q = {"shape": [1, 4, 256, 64], "stride": [65536, 64, 256, 1], "dtype": "bfloat16"}
    docs = {"shape": [1, 256], "stride": [256, 1], "dtype": "int64"}
    context = {"device": "NVIDIA H100 80GB HBM3 sm90", "torch": "2.11.0", "triton": "3.6.0"}
    causal = call_layouts(FORWARD, [q] * 3, None)
    document = call_layouts(FORWARD, [q] * 3, docs)
    backward = call_layouts(BACKWARD, [q] * 6, docs)
    assert (len(causal), len(document), len(backward)) == (11, 12, 15)
    assert not documents_in(causal, FORWARD) and documents_in(document, FORWARD) and documents_in(backward, BACKWARD)
    assert not documents_in(call_layouts(BACKWARD, [q] * 6, None), BACKWARD)
    keys = {flex_key(FORWARD, causal, context), flex_key(FORWARD, document, context),
            flex_key(BACKWARD, backward, context), flex_key(FORWARD, document, dict(context, device="other"))}
    assert len(keys) == 4
    strided = dict(q, stride=[65536, 16384, 64, 1])
    assert flex_key(FORWARD, call_layouts(FORWARD, [strided] * 3, docs), context) != flex_key(FORWARD, document, context)


def test_flex_calls_read_each_call_in_the_kernels_input_order():
    """A graph's flex calls, as the runtime prepares their kernels before the first step: the
    backward op takes grad_out first, its kernels last."""
    import torch.fx as fx

    import titan.runtime.contract.flex_attention  # noqa: F401  (registers the ops)
    from titan.runtime.kernels.flex_kernels import flex_calls

    graph = fx.Graph()
    transposed = {"shape": [1, 2, 256, 32], "stride": [16384, 32, 64, 1], "dtype": "bfloat16"}
    val = {n: transposed for n in ("q", "k", "v", "out")}
    val["grad_out"] = dict(transposed, stride=[16384, 8192, 32, 1])  # another layout: it must land last
    nodes = {}
    for name in ("q", "k", "v", "out", "grad_out", "documents", "lse"):
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["titan_val"] = val.get(name) or (
            {"shape": [1, 256], "stride": [256, 1], "dtype": "int64"} if name == "documents"
            else {"shape": [1, 2, 256], "stride": [512, 256, 1], "dtype": "float32"})
    fwd = graph.call_function(torch.ops.titan.flex_attention.default,
                              (nodes["q"], nodes["k"], nodes["v"], nodes["documents"]))
    bwd = graph.call_function(torch.ops.titan.flex_attention_backward.default,
                              tuple(nodes[n] for n in ("grad_out", "q", "k", "v", "out", "lse")) + (None,))
    graph.output((fwd, bwd))
    (kind_f, forward), (kind_b, backward) = flex_calls(fx.GraphModule(torch.nn.Module(), graph))
    assert (kind_f, kind_b) == (FORWARD, BACKWARD)
    assert forward[:4] == [val["q"], val["k"], val["v"], nodes["documents"].meta["titan_val"]] and len(forward) == 12
    assert backward[:6] == [val["q"], val["k"], val["v"], val["out"], nodes["lse"].meta["titan_val"], val["grad_out"]]
    assert len(backward) == 14 and not documents_in(backward, BACKWARD)  # causal: no document ids

"""titan::flex_attention (runtime/contract/flex_attention.py): PyTorch's FlexAttention math with
the causal or the document mask, the mask computed from document ids that are data.

References: PyTorch's own eager flex_attention (forward; torch 2.13 refuses its backward on CPU)
and its higher-order op's math backward, bit for bit; and, independently, SDPA with an explicit boolean mask built from the document ids (forward and
gradients, within TOLERANCE: float32 sums in another order). Each at Llama's head size and at
DeepSeek-V3's latent attention's, whose values have fewer dims than its queries and keys
(HEAD_SIZES). Artifacts that train with it, bitwise against eager: e2e/test_flex_attention_bitwise.py."""

from __future__ import annotations

import warnings

import msgpack
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

from test_graph_format import _blob, _load, _mm_graph
from titan.builder.models.attention import attention_overrides, attention_tags, describe_attention
from titan.builder.models.decoder import document_ids
from titan.builder.models.llama3.config import FLAVORS
from titan.runtime.contract.flex_attention import flex_attention
from titan.runtime.contract.graph_decode import GraphFormatError

TOLERANCE = dict(rtol=1e-5, atol=2e-6)
"""float32, seq 48, head sizes up to 192: the dense reference's softmax and products sum in
another order."""
EOS = 5
HEAD_SIZES = {"llama": (32, 32), "mla-debug": (24, 16), "mla-671B": (192, 128)}
"""(q and k head size, v head size): a debug Llama's; DeepSeek-V3 debug's latent attention
(16 + 8 rotary, v 16); 16B's and 671B's (128 + 64 rotary, v 128)."""


def _stream_rows() -> torch.Tensor:
    """Two sequences cut from one token stream: a document of 20 tokens, then one that runs from
    sequence 0 across the sequence boundary into sequence 1 (whose first 10 tokens end it),
    then two more; and a third sequence that is one document (no end-of-document token)."""
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(6, 100, (96,), generator=g)
    stream[[19, 57, 70]] = EOS  # ends at positions 19, 57 (= 48 + 9), 70 (= 48 + 22)
    no_ends = torch.randint(6, 100, (48,), generator=g)
    return torch.stack([stream[:48], stream[48:], no_ends])


def test_document_ids_count_the_ends_before_each_token():
    tokens = torch.tensor([[3, EOS, 4, 4, EOS, EOS, 9], [EOS, 1, 2, 3, 4, 6, 7], [1, 2, 3, 4, 6, 7, 8]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1], [0] * 7]


def _qkv(batch: int, *, dtype=torch.float32, grad=False, heads: str = "llama"):
    g = torch.Generator().manual_seed(1)
    qk, v = HEAD_SIZES[heads]
    return tuple(torch.randn(batch, 4, 48, d, generator=g, dtype=dtype).requires_grad_(grad) for d in (qk, qk, v))


@pytest.mark.parametrize("heads", HEAD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", ["causal", "document"])
def test_forward_is_pytorchs_eager_flex_attention_bit_for_bit(masked, dtype, heads):
    docs = document_ids(_stream_rows(), EOS)
    q, k, v = _qkv(docs.shape[0], dtype=dtype, heads=heads)
    if masked == "document":
        def mask_mod(b, h, m, n):
            return (m >= n) & (docs[b, m] == docs[b, n])
    else:
        def mask_mod(b, h, m, n):
            return m >= n
    block_mask = create_block_mask(mask_mod, docs.shape[0], None, 48, 48, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the unfused math path is the point
        expected = torch_flex_attention(q, k, v, block_mask=block_mask)
    assert torch.equal(flex_attention(q, k, v, docs if masked == "document" else None), expected)


@pytest.mark.parametrize("heads", HEAD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_the_higher_order_ops_math_backward_bit_for_bit(dtype, heads):
    import math

    from torch._higher_order_ops.flex_attention import flex_attention_backward
    docs = document_ids(_stream_rows(), EOS)
    q, k, v = _qkv(3, dtype=dtype, heads=heads)
    out, lse = torch.ops.titan.flex_attention(q, k, v, docs)
    assert out.shape == v.shape
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)

    def mask_mod(b, h, m, n):
        return (m >= n) & (docs[b, m] == docs[b, n])
    block_mask = create_block_mask(mask_mod, 3, None, 48, 48, device="cpu")
    expected = flex_attention_backward(q, k, v, out, lse, grad_out, None, lambda score, b, h, m, n: score, None,
                                       block_mask.as_tuple(), 1 / math.sqrt(q.shape[-1]), {}, (), ())[:3]
    got = torch.ops.titan.flex_attention_backward(grad_out, q, k, v, out, lse, docs)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("heads", HEAD_SIZES)
def test_document_mask_matches_dense_sdpa_with_a_boolean_mask(heads):
    docs = document_ids(_stream_rows(), EOS)
    assert docs[1, :10].eq(0).all() and docs[1, 10] == 1, "sequence 1 starts inside a document"
    assert docs[2].eq(0).all(), "sequence 2 is one document"
    q, k, v = _qkv(3, grad=True, heads=heads)
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(2))
    out = flex_attention(q, k, v, docs)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    pos = torch.arange(48)
    allowed = (pos[:, None] >= pos[None, :]) & (docs[:, :, None] == docs[:, None, :])
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    expected = torch.autograd.grad(reference, (q, k, v), grad_out)
    torch.testing.assert_close(out, reference, **TOLERANCE)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, **TOLERANCE)
    # Nothing crosses a document: the first document's outputs ignore every later key.
    moved = v.detach().clone()
    moved[0, :, 20:] += 1.0
    assert torch.equal(flex_attention(q, k, moved, docs)[0, :, :20], out[0, :, :20])


def test_one_document_is_the_causal_mask_exactly():
    q, k, v = _qkv(2, grad=True)
    one = torch.zeros(2, 48, dtype=torch.int64)
    grad_out = torch.randn(2, 4, 48, 32, generator=torch.Generator().manual_seed(3))
    doc_out, causal_out = flex_attention(q, k, v, one), flex_attention(q, k, v, None)
    assert torch.equal(doc_out, causal_out)
    for a, b in zip(torch.autograd.grad(doc_out, (q, k, v), grad_out), torch.autograd.grad(causal_out, (q, k, v), grad_out)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("documents,why", [(torch.zeros(2, 47, dtype=torch.int64), "shape"),
                                           (torch.zeros(2, 48, dtype=torch.int32), "int64"),
                                           (torch.zeros(48, dtype=torch.int64), "shape")])
def test_document_ids_of_the_wrong_shape_or_dtype_are_refused(documents, why):
    q, k, v = _qkv(2)
    with pytest.raises(ValueError, match=why):
        flex_attention(q, k, v, documents)


@pytest.mark.parametrize("cut", [(slice(0, 1),), (slice(None), slice(0, 2)), (slice(None), slice(None), slice(0, 47))],
                         ids=["batch", "heads", "seq"])
def test_values_of_another_batch_heads_or_seq_are_refused(cut):
    """Only the head size of v may differ from q's and k's (latent attention's values)."""
    q, k, v = _qkv(2, heads="mla-debug")
    with pytest.raises(ValueError, match="v of their batch, heads and seq"):
        flex_attention(q, k, v[cut], None)
    with pytest.raises(ValueError, match="q and k of one"):
        flex_attention(q, k[..., :16], v, None)


def test_backward_inputs_of_another_shape_are_refused():
    q, k, v = _qkv(2)
    out, lse = torch.ops.titan.flex_attention(q, k, v, None)
    with pytest.raises(ValueError, match="flex_attention_backward takes grad_out"):
        torch.ops.titan.flex_attention_backward(out[:1], q, k, v, out, lse, None)  # would broadcast
    with pytest.raises(ValueError, match="logsumexp"):
        torch.ops.titan.flex_attention_backward(out, q, k, v, out, lse[..., :1], None)


def _flex_graph(args: list) -> bytes:
    return _blob([
        {"name": "q", "op": "placeholder"},
        {"name": "docs", "op": "placeholder"},
        {"name": "f", "op": "call_function", "target": "titan.flex_attention.default", "args": args, "kwargs": {}},
        {"name": "out", "op": "call_function", "target": "getitem", "args": [{"$n": 2}, 0], "kwargs": {}},
        {"name": "output", "op": "output", "args": [{"$t": [{"$n": 3}]}]},
    ])


def test_a_flex_attention_graph_loads_and_runs():
    q, _, _ = _qkv(2)
    docs = torch.zeros(2, 48, dtype=torch.int64)
    gm = _load(_flex_graph([{"$n": 0}, {"$n": 0}, {"$n": 0}, {"$n": 1}]))
    assert torch.equal(gm(q, docs)[0], flex_attention(q, q, q, docs))


@pytest.mark.parametrize("args,why", [
    ([{"$n": 0}, {"$n": 0}, {"$n": 0}, {"$n": 1}, {"$n": 1}], "positional"),   # one argument too many
    ([{"$n": 0}, {"$n": 0}, {"$n": 0}, "lambda b, h, m, n: True"], "str"),  # a mask as code
    ([{"$n": 0}, {"$n": 0}, {"$n": 0}, [1, 2, 3]], "list"),                  # a mask as a literal
    ([{"$n": 0}, {"$n": 0}, {"$n": 0}], "missing"),
])
def test_hostile_flex_attention_nodes_are_refused_with_one_line(args, why):
    with pytest.raises(GraphFormatError, match=why) as refused:
        _load(_flex_graph(args))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("target", ["higher_order.flex_attention", "torch.ops.higher_order.flex_attention",
                                    "torch._higher_order_ops.flex_attention.flex_attention",
                                    "higher_order.flex_attention_backward"])
def test_torchs_flex_attention_higher_order_op_is_not_a_graph_op(target):
    """Its mask and score functions are subgraphs (code); titan graphs carry the mask as data."""
    blob = _blob([{"name": "q", "op": "placeholder"},
                  {"name": "f", "op": "call_function", "target": target, "args": [{"$n": 0}], "kwargs": {}},
                  {"name": "output", "op": "output", "args": [{"$t": [{"$n": 1}]}]}])
    with pytest.raises(GraphFormatError):
        _load(blob)


DEBUG = FLAVORS["debug"]


@pytest.mark.parametrize("choice,why", [
    (dict(attention="flash"), "unknown --attention"),
    (dict(attention="flex", mask="sliding"), "unknown --mask"),
    (dict(mask="document", eos_id=3), "needs --attention flex"),
    (dict(attention="flex", mask="document"), "needs --eos-id"),
    (dict(attention="flex", eos_id=3), "for --mask document only"),
    (dict(attention="flex", mask="document", eos_id=2048), "outside the vocabulary of 2048"),
])
def test_bad_attention_choices_are_refused_with_the_fix(choice, why):
    full = {"attention": "sdpa", "mask": "causal", "eos_id": None, **choice}
    with pytest.raises(ValueError, match=why):
        attention_overrides(DEBUG, model="llama3", **full)


def test_the_default_choice_leaves_the_config_unchanged():
    assert attention_overrides(DEBUG, model="llama3", attention="sdpa", mask="causal", eos_id=None) == {}
    assert set(DEBUG.as_dict()) & {"attention", "mask", "eos_id"} == set()  # the cache key as before
    assert attention_tags(DEBUG.as_dict()) == [] and describe_attention(DEBUG.as_dict()) == "sdpa causal"


def test_the_memory_estimate_counts_the_dense_kernels_scores_and_mask():
    from titan.runtime.contract.memory_estimate import MemoryEstimate, flex_attention_workspace
    blob = msgpack.unpackb(_flex_graph([{"$n": 0}, {"$n": 0}, {"$n": 0}, {"$n": 1}]), raw=False)
    blob["nodes"][0]["val"] = {"shape": [2, 4, 48, 32], "stride": [6144, 1536, 32, 1], "dtype": "float32"}
    gm = _load(msgpack.packb(blob, use_bin_type=True))
    # the forward: scores and probabilities, float32 (2, 4, 48, 48) each, and the (2, 48, 48) mask
    assert flex_attention_workspace([gm]) == 2 * (2 * 4 * 48 * 48 * 4) + 2 * 48 * 48
    assert flex_attention_workspace([_load(_blob(_mm_graph()))]) == 0
    estimate = MemoryEstimate(param_elements=0, buffers=0, activations=0, attention_workspace=3 << 30)
    assert estimate.at_least == 3 << 30 and "flex attention scores and mask 3.00 GiB" in estimate.describe()


def test_the_choice_is_in_the_cache_key_and_the_name_and_sdpas_key_is_as_before():
    from titan.builder.spec.build_spec import make_spec
    from titan.builder.spec.cache_key import build_factors, digest

    def spec(**choice):
        return make_spec(model="llama3", flavor="debug", tp=2, dp_shard=1, dp_replicate=1, batch_size=None,
                         seq_len=None, **choice)
    sdpa, causal, doc = spec(), spec(attention="flex"), spec(attention="flex", mask="document", eos_id=7)
    assert "attention" not in build_factors(sdpa)["model config"] and sdpa.name == "llama3-debug-tp2"
    assert build_factors(doc)["model config"] == dict(build_factors(sdpa)["model config"], attention="flex",
                                                      mask="document", eos_id=7)
    assert len({digest(build_factors(s)) for s in (sdpa, causal, doc, spec(attention="flex", mask="document",
                                                                           eos_id=8))}) == 4
    assert (causal.name, doc.name) == ("llama3-debug-tp2-flex", "llama3-debug-tp2-flex-doc-eos7")
    # DeepSeek-V3's latent attention offers the same choice, named and keyed the same way.
    mla = make_spec(model="deepseek_v3", flavor="debug", tp=2, dp_shard=1, dp_replicate=1, batch_size=None,
                    seq_len=None, attention="flex", mask="document", eos_id=511)
    assert mla.name == "deepseek_v3-debug-tp2-flex-doc-eos511"
    assert {k: build_factors(mla)["model config"][k] for k in ("attention", "mask", "eos_id")} == \
        {"attention": "flex", "mask": "document", "eos_id": 511}


def _latent_attention(attention: str, **shape):
    """DeepSeek-V3 debug's attention block (with `shape` overrides), seeded weights."""
    import dataclasses

    from titan.builder.models.deepseek_v3.config import FLAVORS as DEEPSEEK
    from titan.builder.models.deepseek_v3.model import MultiHeadLatentAttention
    torch.manual_seed(0)
    return MultiHeadLatentAttention(dataclasses.replace(DEEPSEEK["debug"], attention=attention, **shape))


@pytest.mark.parametrize("shape", [{}, dict(rope_factor=40.0)], ids=["debug", "debug-yarn"])
def test_latent_attention_through_flex_is_its_sdpa_attention(shape):
    """MLA routed through the flex op (v at its own head size, YaRN's temperature on q) computes
    the causal SDPA path's attention (v padded to q's head size), within TOLERANCE; with one
    document per sequence, exactly the flex causal mask; and across a boundary, a later
    document's tokens change nothing before it."""
    from titan.builder.models.deepseek_v3.model import rope_tables
    flex, sdpa = _latent_attention("flex", **shape), _latent_attention("sdpa", **shape)
    x = torch.randn(3, 48, flex.cfg.dim, generator=torch.Generator().manual_seed(5))
    cos, sin = rope_tables(48, flex.cfg, "cpu")
    causal = flex(x, cos, sin)
    torch.testing.assert_close(causal, sdpa(x, cos, sin), **TOLERANCE)
    assert torch.equal(flex(x, cos, sin, documents=torch.zeros(3, 48, dtype=torch.int64)), causal)
    docs = document_ids(_stream_rows(), EOS)
    masked = flex(x, cos, sin, documents=docs)
    assert not torch.allclose(masked, causal)
    moved = x.clone()
    moved[0, 20:] += 1.0
    assert torch.equal(flex(moved, cos, sin, documents=docs)[0, :20], masked[0, :20])

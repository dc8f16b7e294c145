"""The ops a titan graph may call: exactly those titan-build emits for its models, in every
layout, pass set, dtype and activation-checkpointing mode (collected by building the debug
layouts under each and reading the graphs back, then reviewed by hand), versioned with the
graph format. A graph naming anything else is refused before it is built, so a crafted
artifact cannot reach the rest of aten: ops that read files, address memory through raw
strides or storages, or skip bounds checks by design (`_unsafe_index`, `_unsafe_index_put`,
`_unsafe_masked_index*`, `as_strided`, `set_`, `from_file`, ...) are simply not here.

`_unsafe_view` is here: it is `view` without autograd's alias tracking, checks its size as
`view` does, and AOT autograd emits it for every reshape.

A builder change that emits a new op fails tests/e2e/test_op_allowlist.py until the op is
reviewed and added here (and OPS_VERSION bumped when an artifact could then carry it).
"""

from __future__ import annotations

OPS_VERSION = 3  # 3: FlexAttention and document ids (issue 31)

ALLOWED_OPS: frozenset[str] = frozenset({
    # collectives (process groups are bound by the runtime: "$group")
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.wait_tensor.default",
    # attention, dispatched per device (runtime/contract/ops.py)
    "titan.attention.default",
    "titan.attention_backward.default",
    # FlexAttention, causal or document-masked (runtime/contract/flex_attention.py), and the
    # document ids it is given: eq (end-of-document tokens) and cumsum, inside the step
    "titan.flex_attention.default",
    "titan.flex_attention_backward.default",
    "aten.eq.Scalar",
    # matmul, loss, embedding
    "aten.mm.default",
    "aten._log_softmax.default",
    "aten._log_softmax_backward_data.default",
    "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default",
    "aten.embedding.default",
    "aten.embedding_dense_backward.default",
    # the vocab-parallel embedding's mask with --passes '' (bounds-checked, unlike _unsafe_index_put)
    "aten.index_put.default",
    # element-wise
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.mul.Scalar",
    "aten.div.Tensor",
    "aten.div.Scalar",
    "aten.neg.default",
    "aten.pow.Scalar",
    "aten.pow.Tensor_Scalar",
    "aten.reciprocal.default",
    "aten.rsqrt.default",
    "aten.cos.default",
    "aten.sin.default",
    "aten.silu.default",
    "aten.silu_backward.default",
    "aten.bitwise_or.Tensor",
    "aten.ge.Scalar",
    "aten.lt.Scalar",
    "aten.where.self",
    "aten._to_copy.default",
    "aten.clone.default",
    "aten.detach.default",
    "aten.lift_fresh_copy.default",
    # reductions
    "aten.mean.dim",
    "aten.sum.dim_IntList",
    # creation (sizes bounded by the loader)
    "aten.arange.default",
    "aten.arange.start_step",
    # shape and layout (views check their sizes against their input)
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.expand.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.select.int",
    "aten.select_backward.default",
    "aten.slice.Tensor",
    "aten.split.Tensor",
    "aten.cat.default",
    "aten.stack.default",
    # DeepSeek-V3 (MoE): routing, token dispatch and the grouped expert GEMM; index, gather and
    # scatter check their indices (a device-side assert on CUDA), unlike the _unsafe_ variants
    "_c10d_functional.all_to_all_single.default",
    "aten.bitwise_not.default",
    "aten.clamp.default",
    "aten.constant_pad_nd.default",
    "aten.copy.default",
    "aten.cumsum.default",
    "aten.floor_divide.default",
    "aten.gather.default",
    "aten.index.Tensor",
    "aten.lt.Tensor",
    "aten.masked_fill.Scalar",
    "aten.mean.default",
    "aten.new_zeros.default",
    "aten.rsub.Scalar",
    "aten.scalar_tensor.default",
    "aten.scatter.value",
    "aten.searchsorted.Tensor",
    "aten.sigmoid.default",
    "aten.sign.default",
    "aten.sort.default",
    "aten.sort.stable",
    "aten.split_with_sizes.default",
    "aten.sum.default",
    "aten.topk.default",
    "aten.zeros_like.default",
    "titan.grouped_mm.default",
    "aten.scatter_add.default",
    "aten.sigmoid_backward.default",
    "aten.slice_backward.default",
    # Qwen3's softmax router: the softmax, and topk's backward (a bounds-checked scatter of the
    # chosen probabilities' gradients into zeros)
    "aten._softmax.default",
    "aten._softmax_backward_data.default",
    "aten.scatter.src",
})

"""The vocab-parallel embedding's out-of-shard mask without a host sync (a CUDA graph cannot
capture one)."""

from __future__ import annotations

import torch
import torch.fx as fx

from titan.builder.passes.registry import PassContext


def mask_index_put_to_where_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """index_put(x, [bool_mask], scalar) -> where(mask, scalar, x).

    The vocab-parallel embedding masks out-of-shard ids this way. A boolean-mask index_put
    runs nonzero() first, a device-to-host sync that a CUDA graph cannot capture; where() is
    the same selection with no sync, and writes the same bits.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.target is not aten.index_put.default:
            continue
        x, indices, values = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if accumulate or len(indices) != 1 or indices[0] is None:
            continue
        mask = indices[0]
        mask_val, x_val, v_val = mask.meta["val"], x.meta["val"], values.meta["val"]
        if mask_val.dtype != torch.bool or v_val.dim() != 0 or v_val.dtype != x_val.dtype:
            continue
        if tuple(mask_val.shape) != tuple(x_val.shape[:mask_val.dim()]):
            continue
        with gm.graph.inserting_before(node):
            cond = mask
            extra = x_val.dim() - mask_val.dim()
            if extra:
                shape = list(mask_val.shape) + [1] * extra
                cond = gm.graph.call_function(aten.view.default, (mask, shape))
                cond.meta = dict(mask.meta, val=mask_val.view(shape))
            where = gm.graph.call_function(aten.where.self, (cond, values, x))
            where.meta = dict(node.meta)
        node.replace_all_uses_with(where)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm

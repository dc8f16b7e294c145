"""Graph passes: each `name_pass(gm) -> gm` does one job, is chosen by name from PASSES
(`titan-build --passes`), and is recorded in the artifact's pass list (and so in the cache key).

This module imports torch only inside the passes: the registry is read on the cache-hit path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.fx as fx


def mask_index_put_to_where_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """index_put(x, [bool_mask], scalar) -> where(mask, scalar, x).

    The vocab-parallel embedding masks out-of-shard ids this way. A boolean-mask index_put
    runs nonzero() first, a device-to-host sync that a CUDA graph cannot capture; where() is
    the same selection with no sync, and writes the same bits.
    """
    import torch

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


@dataclass(frozen=True)
class GraphPass:
    fn: Callable[[fx.GraphModule], fx.GraphModule]
    """The pass; applied to the forward and to the backward graph."""
    preserves_numerics: bool
    """False for passes whose results may differ from eager (opt-in, labeled)."""
    summary: str
    """One line for --list-passes."""


PASSES: dict[str, GraphPass] = {
    "mask_index_put_to_where": GraphPass(
        mask_index_put_to_where_pass, True,
        "boolean-mask index_put -> where: same bits, no host sync (lets CUDA graphs capture the "
        "vocab-parallel embedding)"),
}
# Applied, in this order, when --passes is not given.
DEFAULT_PASSES = ("mask_index_put_to_where",)


def check_pass_names(names: tuple[str, ...]) -> None:
    for name in names:
        if name not in PASSES:
            raise ValueError(f"unknown pass {name!r}; titan-build --list-passes shows them")
    if len(set(names)) != len(names):
        raise ValueError(f"--passes lists a pass twice: {', '.join(names)}")

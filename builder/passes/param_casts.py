"""The parameters' casts to the compute dtype out of the forward graph: the forward takes each
such parameter as its compute-dtype copy, which titan-run keeps and the optimizer step writes as
it writes the parameter (runtime/param_copies.py); and the backward returns the copy's gradient,
whose upcast (the parameter's gradient) the update makes as it reads it.

A mixed-precision forward starts by casting every fp32 parameter to bf16, and its backward
ends by casting each bf16 weight gradient to fp32: at 1B parameters, 6 bytes read and written
per parameter each, about 2 ms of an H200 step each, in passes of their own. The optimizer step
already reads and writes every parameter and reads every gradient: writing the bf16 copy there
costs 2 bytes per parameter, and reading a bf16 gradient 2 bytes fewer. A cast to bf16 rounds
once (to nearest even, in ATen's copy and in the AdamW kernel alike) and one to fp32 is exact,
so both hold the bits the graph's casts gave.

Left in the graph: a parameter that the forward also reads as it is, casts to several dtypes, or
whose cast feeds a collective (an FSDP shard cast before its all-gather, which the bucketing
passes and a pipeline's once-per-step gather read as they are).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from titan.builder.passes.collectives import STARTS
from titan.builder.passes.regions import exact_op
from titan.builder.passes.registry import PassContext

aten = torch.ops.aten
COPY_DTYPES = (torch.bfloat16, torch.float16)
"""The compute dtypes a parameter's copy may have (runtime/contract/rank_record.py: CAST_DTYPES)."""


def _plain_cast(node) -> torch.dtype | None:
    """The dtype `node` casts its input to, if it is a plain cast (a dtype change only)."""
    if not isinstance(node, fx.Node) or node.target is not aten._to_copy.default or not exact_op(node):
        return None
    return node.kwargs.get("dtype")


def _cast_dtype(param: fx.Node) -> torch.dtype | None:
    """The one dtype every use of `param` casts it to, if that is all its uses do."""
    users = list(param.users)
    if param.meta["val"].dtype != torch.float32 or not users:
        return None
    dtypes = {_plain_cast(user) for user in users}
    if any(user.args[0] is not param or any(u.op == "call_function" and u.target in STARTS for u in user.users)
           for user in users):
        return None
    return dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in COPY_DTYPES else None


def fold_param_casts_pass(gm: fx.GraphModule, *, ctx: PassContext) -> fx.GraphModule:
    """Forward graph: each parameter input whose uses are all one cast takes the cast's value
    instead (ctx.input_casts records it, by input index). Backward graph (its context shares
    input_casts): the gradient of such a parameter, where it is the upcast of the copy's
    gradient and nothing else reads it, is returned as the copy's gradient (the runtime upcasts
    it as it reads it: runtime/param_copies.py)."""
    if ctx.graph == "backward":
        return _return_copy_gradients(gm, ctx)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, (node, name) in enumerate(zip(placeholders, ctx.input_names)):
        if name is None or (dtype := _cast_dtype(node)) is None:
            continue
        casts = list(node.users)
        node.meta["val"] = casts[0].meta["val"]
        for cast in casts:
            cast.replace_all_uses_with(node)
            gm.graph.erase_node(cast)
        ctx.input_casts[index] = str(dtype).removeprefix("torch.")
    gm.graph.lint()
    gm.recompile()
    return gm


def _return_copy_gradients(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    grads = list(output.args[0])
    for index, dtype in ctx.input_casts.items():
        upcast = grads[index]
        if (_plain_cast(upcast) != torch.float32 or len(upcast.users) != 1
                or str(upcast.args[0].meta["val"].dtype).removeprefix("torch.") != dtype):
            continue
        grads[index] = upcast.args[0]
        output.args = (tuple(grads),)
        gm.graph.erase_node(upcast)
    gm.graph.lint()
    gm.recompile()
    return gm

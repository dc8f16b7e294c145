"""Write an FX graph in the titan graph format (spec and reader: graph_decode.py, beside it).

Canonicalizes on the way: process-group names become mesh-dimension names and devices become
"local", so ranks whose graphs differ only in those write identical bytes.
"""

from __future__ import annotations

from typing import Any

import msgpack
import safetensors.torch
import torch
import torch.fx as fx

from titan.runtime.contract.graph_decode import target_name
from titan.runtime.contract.graph_doc import (DEVICE, DTYPE, FORMAT, GROUP, LAYOUT, MEMORY_FORMAT, NODE, TUPLE,
                                             VERSION)

_C10D_NS = "_c10d_functional"


def _tensor_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"shape": list(v.shape), "stride": list(v.stride()), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, (tuple, list)):
        return [_tensor_meta(x) for x in v]
    if isinstance(v, int) and not isinstance(v, bool):
        return {"int": v}
    return None


class _Encoder:
    def __init__(self, index: dict[fx.Node, int], group_names: dict[str, str]):
        self.index = index
        self.group_names = group_names

    def value(self, v: Any, *, group_arg: bool = False) -> Any:
        if isinstance(v, fx.Node):
            return {NODE: self.index[v]}
        if isinstance(v, bool) or v is None or isinstance(v, (int, float)):
            return v
        if isinstance(v, str):
            if group_arg:
                if v not in self.group_names:
                    raise ValueError(f"collective on process group {v!r}, which is not a mesh dimension")
                return {GROUP: self.group_names[v]}
            return v
        if isinstance(v, tuple):
            return {TUPLE: [self.value(x) for x in v]}
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, torch.dtype):
            return {DTYPE: str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {DEVICE: "local"}
        if isinstance(v, torch.layout):
            return {LAYOUT: str(v).removeprefix("torch.")}
        if isinstance(v, torch.memory_format):
            return {MEMORY_FORMAT: str(v).removeprefix("torch.")}
        raise ValueError(f"cannot encode graph argument {v!r} ({type(v).__name__})")


def _group_arg_names(target: Any) -> frozenset[str]:
    """Names of the arguments of `target` that hold a process-group name."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == _C10D_NS:
        return frozenset(a.name for a in target._schema.arguments if a.name == "group_name")
    return frozenset()


def _module_path(node: fx.Node) -> str:
    custom = node.meta.get("custom") or {}
    return str(custom.get("module", ""))


def encode_graph(gm: fx.GraphModule, *, group_names: dict[str, str]) -> bytes:
    """Serialize `gm`. `group_names` maps real process-group names to mesh-dimension names.

    Must be called with no FakeTensorMode active: constants are read as real tensors.
    """
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    enc = _Encoder(index, group_names)
    nodes = []
    constants: dict[str, torch.Tensor] = {}
    for n in gm.graph.nodes:
        rec: dict[str, Any] = {"name": n.name, "op": n.op}
        if n.op == "call_function":
            rec["target"] = target_name(n.target)
            groups = _group_arg_names(n.target)
            schema_args = n.target._schema.arguments if groups else []
            rec["args"] = [enc.value(a, group_arg=i < len(schema_args) and schema_args[i].name in groups)
                           for i, a in enumerate(n.args)]
            rec["kwargs"] = {k: enc.value(v, group_arg=k in groups) for k, v in n.kwargs.items()}
        elif n.op == "get_attr":
            rec["target"] = n.target
            t = getattr(gm, n.target)
            assert not isinstance(t, torch._subclasses.FakeTensor), "encode constants outside fake mode"
            constants[n.target] = t.detach().cpu().contiguous()
        elif n.op == "output":
            rec["args"] = [enc.value(n.args[0])]
        elif n.op != "placeholder":
            raise ValueError(f"graph node kind {n.op!r} is not supported")
        rec["val"] = _tensor_meta(n.meta.get("val"))
        module = _module_path(n)
        if module:
            rec["module"] = module
        if n.meta.get("titan_region"):
            rec["region"] = n.meta["titan_region"]
        nodes.append(rec)
    doc = {"format": FORMAT, "version": VERSION, "nodes": nodes,
           "constants": safetensors.torch.save(constants) if constants else None}
    return msgpack.packb(doc, use_bin_type=True)


"""DeepSeek-V3's expert-parallel step never waits for the host: the whole step (forward and
backward, exported as the builder exports it) holds no op that reads a device value on the host
or makes a shape data dependent, and no tensor that lives on the host: traced on the meta
device, every value must stay there, so a tensor made on the CPU (a `.cpu()`, a
`torch.tensor(list)`, a `.tolist()` round trip) shows. (The graphs titan-build writes:
e2e/test_deepseek_v3_graphs.py.)"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import fx

from deepseek_debug import ALL_TO_ALL, CFG, HOST_SYNC_OPS, SEQ
from titan.builder.models.moe.expert_parallel import set_dispatch, shard_experts
from titan.builder.models.deepseek_v3.model import DeepSeekV3


def host_sync_ops(graph: fx.Graph) -> set[str]:
    """The graph's calls of HOST_SYNC_OPS (by overload packet or full name)."""
    found = set()
    for n in graph.nodes:
        if n.op == "call_function":
            name = str(n.target)
            found |= {name, name.rsplit(".", 1)[0]} & HOST_SYNC_OPS
    return found


def test_expert_parallel_step_traces_to_static_shapes_without_host_sync():
    """The debug model's step at ep=2, traced on the meta device."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    meta = torch.device("meta")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with meta:
            model = DeepSeekV3(CFG)
        shard_experts(model, ep=2, ep_rank=0)
        plan = set_dispatch(model, tokens=2 * SEQ, ep=2, ep_group=dist.group.WORLD,
                            load_groups=(dist.group.WORLD,))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=meta)
            tokens = torch.empty(2, SEQ, dtype=torch.long, device=meta)
        with contextlib.ExitStack() as stack:
            graph = aot_export_joint_with_descriptors(stack, model, (tokens, tokens)).graph_module.graph
    finally:
        dist.destroy_process_group()
    assert not host_sync_ops(graph), host_sync_ops(graph)
    for n in graph.nodes:
        val = n.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(v, torch.Tensor):
                assert v.device == meta, f"{n.format_node()} makes a tensor on {v.device}, not on the step's device"
                assert all(isinstance(s, int) for s in v.shape), f"{n.name} has a data-dependent shape"
            else:
                assert not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)), n.name
    calls = [n for n in graph.nodes if n.op == "call_function"]
    a2a = [n for n in calls if str(n.target) == ALL_TO_ALL]
    # Per MoE layer: tokens out, counts out, results back; their two gradients back.
    assert len(a2a) == 5 * CFG.n_moe_layers
    assert all(n.args[1] == n.args[2] and n.args[1] in ([plan.capacity] * 2, [plan.experts_per_rank] * 2)
               for n in a2a)
    assert sum(str(n.target) == "titan.grouped_mm.default" for n in calls) == 9 * CFG.n_moe_layers

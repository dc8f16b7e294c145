"""How the graph passes scale with depth: CPU seconds of each default pass on rank 0 of a
debug-width Llama with N layers under dp-shard 2 x tp 2 (all passes apply there).

    python benchmarks/pass_scaling.py 16 64      # one line per pass and depth

A linear pass takes ~4x the time at 4x the layers. CPU time, not wall time: the build machines
are shared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import torch
import torch.distributed as dist
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan.builder.trace.rank_trace import rank_trace as trace
from titan.builder.spec.build_spec import make_spec
from titan.builder.trace.parallelize import parallelize
from titan.builder.passes.registry import PASSES, PassContext
from titan.runtime.contract.layout import mesh_dims_by_group


def pass_seconds(n_layers: int) -> tuple[int, dict[str, float]]:
    """(nodes in forward + backward, CPU seconds per pass)."""
    spec = make_spec(model="llama3", flavor="debug", tp=2, dp_shard=2, dp_replicate=1, batch_size=None, seq_len=None)
    family, layout = spec.model_spec, spec.layout
    cfg = dataclasses.replace(spec.cfg, n_layers=n_layers)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        mesh = layout.build_mesh("cpu")
        with torch.device("meta"):
            model = family.build(cfg)
        model.loss_scale = 1.0
        parallelize(model, layout, mesh, layout.coordinates(0), tp_plan=family.tp_plan)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            tokens = torch.empty(2, 128, dtype=torch.long)
        with contextlib.ExitStack() as stack:
            stack.enter_context(trace.module_provenance(model))
            gm = aot_export_joint_with_descriptors(stack, model, (tokens, tokens.clone())).graph_module
            inputs = [trace._desc_input(n.meta["desc"]) for n in gm.graph.nodes if n.op == "placeholder"]
            fw, bw = trace.PARTITION_FNS["min_cut"](trace.copy_graph_module(gm), None, num_fwd_outputs=1)
            groups = mesh_dims_by_group(mesh)
            names = [i.fqn for i in inputs if i.kind != "tangent"]
            fw_ctx = PassContext(graph="forward", model=family, mesh_dims=groups, input_names=names, output_names=[])
            bw_ctx = PassContext(graph="backward", model=family, mesh_dims=groups, input_names=[], output_names=names)
            nodes = len(fw.graph.nodes) + len(bw.graph.nodes)
            seconds = {}
            for name in spec.graph_passes:
                t = time.process_time()
                fw, bw = PASSES[name].fn(fw, ctx=fw_ctx), PASSES[name].fn(bw, ctx=bw_ctx)
                seconds[name] = time.process_time() - t
        return nodes, seconds
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    for depth in map(int, sys.argv[1:] or ["16", "64"]):
        nodes, seconds = pass_seconds(depth)
        print(f"{depth} layers ({nodes} nodes): " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()), flush=True)

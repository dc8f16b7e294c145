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

from titan.builder import trace
from titan.builder.layout import Layout
from titan.builder.models.llama3 import Llama3
from titan.builder.models.llama3_config import FLAVORS
from titan.builder.parallelize import build_mesh, parallelize
from titan.builder.passes import PASSES, PassContext, default_passes


def pass_seconds(n_layers: int) -> tuple[int, dict[str, float]]:
    """(nodes in forward + backward, CPU seconds per pass)."""
    cfg = dataclasses.replace(FLAVORS["debug"], n_layers=n_layers)
    layout = Layout(dp_shard=2, tp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        mesh = build_mesh(layout, "cpu")
        with torch.device("meta"):
            model = Llama3(cfg)
        model.loss_scale = 1.0
        parallelize(model, layout, mesh, layout.coordinates(0))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            tokens = torch.empty(2, 128, dtype=torch.long)
        with contextlib.ExitStack() as stack:
            stack.enter_context(trace.module_provenance(model))
            gm = aot_export_joint_with_descriptors(stack, model, (tokens, tokens.clone())).graph_module
            inputs = [trace._desc_input(n.meta["desc"]) for n in gm.graph.nodes if n.op == "placeholder"]
            fw, bw = trace.PARTITION_FNS["min_cut"](trace.copy_graph_module(gm), None, num_fwd_outputs=1)
            groups = trace._group_names(mesh)
            names = [i.get("fqn") for i in inputs if i["kind"] != "tangent"]
            fw_ctx = PassContext(graph="forward", mesh_dims=groups, input_names=names, output_names=[])
            bw_ctx = PassContext(graph="backward", mesh_dims=groups, input_names=[], output_names=names)
            nodes = len(fw.graph.nodes) + len(bw.graph.nodes)
            seconds = {}
            for name in default_passes(dict(layout.mesh_shape())):
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

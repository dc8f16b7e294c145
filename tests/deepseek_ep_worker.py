"""One rank of a DeepSeek-V3 step with expert parallelism over gloo (tests start it).

    python deepseek_ep_worker.py DIR [--ep N] [--capacity-factor F] [--routing] [--graph [--ac POLICY]]

Reads DIR/weights.safetensors (global weights and balancing biases, titan names) and
DIR/batch.safetensors (the global tokens and labels). Every rank is data parallel and takes
rows r::world of the batch; the expert-parallel groups are runs of N consecutive ranks (ep
innermost, carved from the data-parallel ranks), so with world > N the experts are replicated
over world / N groups. Runs the step eagerly and, with --graph, also as the builder ships it:
exported forward + backward, partitioned, written in the titan graph format, read back and run.
Writes DIR/rank{r}.safetensors: per mode ("eager.", "graph.") the global loss, every gradient
(data-parallel ones summed over all ranks, expert ones this rank's slice summed over its
replicas) and the MoE layers' buffers after the step; with --routing also each MoE layer's
router choices in the eager step ("eager.routing.<layer>": (tokens, top_k) expert ids).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode

from titan.runtime.contract.graph_encode import encode_graph
from titan.builder.models.deepseek_v3.config import FLAVORS
from titan.builder.models.moe.expert_parallel import is_expert_param, set_dispatch, shard_experts
from titan.builder.models.deepseek_v3.model import DeepSeekV3
from titan.builder.models.deepseek_v3.moe import route
from titan.builder.passes.checkpointing import tag_activation_checkpointing
from titan.builder.models.deepseek_v3 import SPEC
from titan.builder.trace.rank_trace import copy_graph_module, module_provenance
from titan.runtime.contract.graph_decode import load_graph


class Step:
    """This rank's model and share of the batch."""

    def __init__(self, args, ep_group, *, device: str = "cpu"):
        rank, world, ep = dist.get_rank(), dist.get_world_size(), args.ep
        with torch.device("meta"):
            self.model = DeepSeekV3(FLAVORS["debug"])
        batch = load_file(args.dir / "batch.safetensors")
        # Contiguous, as a runtime's batches are (the graphs were traced with contiguous inputs).
        self.tokens, self.labels = (batch[k][rank::world].contiguous() for k in ("tokens", "labels"))
        self.model.loss_scale = float(batch["tokens"].numel())
        shard_experts(self.model, ep=ep, ep_rank=rank % ep)
        set_dispatch(self.model, tokens=self.tokens.numel(), ep=ep, ep_group=ep_group, load_groups=(dist.group.WORLD,),
                     capacity_factor=args.capacity_factor)
        if device == "meta":
            return
        self.model.to_empty(device=device)
        weights = load_file(args.dir / "weights.safetensors")
        with torch.no_grad():
            for fqn, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
                full = weights.get(fqn, torch.zeros_like(t))
                t.copy_(full.narrow(0, rank % ep * t.shape[0], t.shape[0]) if is_expert_param(fqn) else full)


def record_routing(step: Step, out: dict) -> None:
    """Each MoE layer's expert ids, routed again in a hook before its forward (from the same
    input and balancing bias), into out["eager.routing.<layer>"]."""
    layers = set(step.model.moe_layers())
    for name, moe in step.model.named_modules():
        if moe in layers:
            moe.register_forward_pre_hook(lambda module, args, name=name: out.__setitem__(
                f"eager.routing.{name}", route(args[0].flatten(0, -2), module.gate.weight, module.expert_bias,
                                               module.cfg)[0].clone()))


def eager_step(step: Step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = step.model(step.tokens, step.labels)
    loss.backward()
    return loss.detach(), {fqn: p.grad for fqn, p in step.model.named_parameters()}


def graph_step(step: Step, traced: Step, groups: dict[str, str], ac: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Export `traced` (the same rank on the meta device) with activation-checkpointing policy
    `ac`, write and read back its forward and backward graphs, and run them on `step`'s
    parameters and buffers; the buffers' new values (the input mutations the forward returns)
    are copied back after the backward, as a runtime must."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        traced.model.to_empty(device="cpu")
        example = torch.empty_like(step.tokens, device="cpu")
    with contextlib.ExitStack() as stack:
        stack.enter_context(module_provenance(traced.model))
        joint = aot_export_joint_with_descriptors(stack, traced.model, (example, example)).graph_module
        inputs = [n.meta["desc"] for n in joint.graph.nodes if n.op == "placeholder"]
        outputs = next(n for n in joint.graph.nodes if n.op == "output").meta["desc"]
        mutated = [d.mutated_input.target for d in outputs if type(d).__name__ == "InputMutationAOTOutput"]
        joint = copy_graph_module(joint)
        tag_activation_checkpointing(joint, ac, ac_block=SPEC.ac_block)
        fw, bw = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=len(mutated) + 1)
    names = {real: dim for dim, real in groups.items()}
    fw, bw = (load_graph(encode_graph(g, group_names=names), device=torch.device("cpu"), groups=groups) for g in (fw, bw))
    params, buffers = dict(step.model.named_parameters()), dict(step.model.named_buffers())
    values = {"ParamAOTInput": params, "BufferAOTInput": buffers}
    args = [values[type(d).__name__][d.target] if type(d).__name__ in values else (step.tokens, step.labels)[d.idx]
            for d in inputs if type(d).__name__ != "TangentAOTInput"]
    with torch.no_grad():
        out = fw(*[a.detach() for a in args])
        loss, saved = out[len(mutated)], out[len(mutated) + 1:]
        grads = bw(*saved, torch.ones_like(loss))
        # Only after the backward: with activation checkpointing it recomputes the routing from
        # the old balancing bias, which it holds as a saved input (the buffer itself).
        for fqn, value in zip(mutated, out):
            buffers[fqn].copy_(value)
    forward_inputs = [d for d in inputs if type(d).__name__ != "TangentAOTInput"]
    return loss, {d.target: g for d, g in zip(forward_inputs, grads) if type(d).__name__ == "ParamAOTInput"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the world size)")
    parser.add_argument("--capacity-factor", type=float, default=None)
    parser.add_argument("--graph", action="store_true", help="also run the step as exported graphs")
    parser.add_argument("--routing", action="store_true", help="also save each MoE layer's router choices (eager)")
    parser.add_argument("--ac", default="none", help="the graphs' activation-checkpointing policy")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.ep = ep = args.ep or world
    # Every rank creates every group, in the same order.
    ep_groups = [dist.new_group(list(range(start, start + ep))) for start in range(0, world, ep)]
    replica_groups = [dist.new_group(list(range(i, world, ep))) for i in range(ep)]
    ep_group, replica_group = ep_groups[rank // ep], replica_groups[rank % ep]
    groups = {"ep": ep_group.group_name, "dp": dist.group.WORLD.group_name}

    out = {}
    modes = {"eager": lambda s: eager_step(s)}
    if args.graph:
        modes["graph"] = lambda s: graph_step(s, Step(args, ep_group, device="meta"), groups, args.ac)
    for mode, run in modes.items():
        step = Step(args, ep_group)
        if args.routing and mode == "eager":
            record_routing(step, out)
        loss, grads = run(step)
        out[f"{mode}.loss"] = loss.clone()
        dist.all_reduce(out[f"{mode}.loss"])
        for fqn, grad in grads.items():
            grad = grad.contiguous()  # graph gradients may be strided views (a transpose's)
            dist.all_reduce(grad, group=replica_group if is_expert_param(fqn) else None)
            out[f"{mode}.grad.{fqn}"] = grad
        for fqn, buf in step.model.named_buffers():
            out[f"{mode}.buffer.{fqn}"] = buf.clone()
    save_file(out, args.dir / f"rank{rank}.safetensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

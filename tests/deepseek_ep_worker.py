"""One rank of an eager DeepSeek-V3 step with expert parallelism over gloo (tests start it).

    python deepseek_ep_worker.py DIR [--ep N] [--capacity-factor F]

Reads DIR/weights.safetensors (global weights, titan names) and DIR/batch.safetensors (the
global tokens and labels). Every rank is data parallel and takes rows r::world of the batch;
the expert-parallel groups are runs of N consecutive ranks (ep innermost, carved from the
data-parallel ranks), so with world > N the experts are replicated over world / N groups.
Writes DIR/rank{r}.safetensors: the global loss, every gradient (data-parallel ones summed
over all ranks, expert ones this rank's slice summed over its replicas) and the MoE layers'
buffers after the step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from titan.builder.models.deepseek_v3.config import FLAVORS
from titan.builder.models.deepseek_v3.expert_parallel import is_expert_param, set_dispatch, shard_experts
from titan.builder.models.deepseek_v3.model import DeepSeekV3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the world size)")
    parser.add_argument("--capacity-factor", type=float, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep or world
    # Every rank creates every group, in the same order.
    ep_groups = [dist.new_group(list(range(start, start + ep))) for start in range(0, world, ep)]
    replica_groups = [dist.new_group(list(range(i, world, ep))) for i in range(ep)]
    ep_group, replica_group = ep_groups[rank // ep], replica_groups[rank % ep]
    cfg = FLAVORS["debug"]
    model = DeepSeekV3(cfg)
    model.load_state_dict(load_file(args.dir / "weights.safetensors"), strict=False)
    if (args.dir / "bias.safetensors").exists():
        model.load_state_dict(load_file(args.dir / "bias.safetensors"), strict=False)
    batch = load_file(args.dir / "batch.safetensors")
    tokens, labels = batch["tokens"][rank::world], batch["labels"][rank::world]
    model.loss_scale = float(batch["tokens"].numel())
    shard_experts(model, ep=ep, ep_rank=rank % ep)
    set_dispatch(model, tokens=tokens.numel(), ep=ep, ep_group=ep_group, load_group=dist.group.WORLD,
                 capacity_factor=args.capacity_factor)

    loss = model(tokens, labels)
    loss.backward()
    out = {"loss": loss.detach().clone()}
    dist.all_reduce(out["loss"])
    for fqn, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=replica_group if is_expert_param(fqn) else None)
        out["grad." + fqn] = grad
    for fqn, buf in model.named_buffers():
        out["buffer." + fqn] = buf.clone()
    save_file(out, args.dir / f"rank{rank}.safetensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

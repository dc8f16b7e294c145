"""One rank of an eager DeepSeek-V3 step with expert parallelism over gloo (tests start it).

    python deepseek_ep_worker.py DIR [--capacity-factor F]

Reads DIR/weights.safetensors (global weights, titan names), DIR/batch.safetensors (the
global tokens and labels) and DIR/bias.safetensors (optional: balancing biases to start from);
rank r of the world (every rank one expert-parallel and data-parallel rank) takes rows r::world
of the batch and its experts. Writes DIR/rank{r}.safetensors: the global loss, every
gradient (data-parallel ones summed over ranks, expert ones this rank's slice) and the MoE
layers' buffers after the step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from titan.builder.models.deepseek_v3.config import FLAVORS
from titan.builder.models.deepseek_v3.expert_parallel import is_expert_param, set_dispatch, shard_experts
from titan.builder.models.deepseek_v3.model import DeepSeekV3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--capacity-factor", type=float, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = FLAVORS["debug"]
    model = DeepSeekV3(cfg)
    model.load_state_dict(load_file(args.dir / "weights.safetensors"), strict=False)
    if (args.dir / "bias.safetensors").exists():
        model.load_state_dict(load_file(args.dir / "bias.safetensors"), strict=False)
    batch = load_file(args.dir / "batch.safetensors")
    tokens, labels = batch["tokens"][rank::world], batch["labels"][rank::world]
    model.loss_scale = float(batch["tokens"].numel())
    shard_experts(model, ep=world, ep_rank=rank)
    set_dispatch(model, tokens=tokens.numel(), ep=world, ep_group=dist.group.WORLD, load_group=dist.group.WORLD,
                 capacity_factor=args.capacity_factor)

    loss = model(tokens, labels)
    loss.backward()
    out = {"loss": loss.detach().clone()}
    dist.all_reduce(out["loss"])
    for fqn, p in model.named_parameters():
        grad = p.grad.clone()
        if not is_expert_param(fqn):
            dist.all_reduce(grad)
        out["grad." + fqn] = grad
    for fqn, buf in model.named_buffers():
        out["buffer." + fqn] = buf.clone()
    save_file(out, args.dir / f"rank{rank}.safetensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What the static dispatch buffers cost: trace one MoE layer of a flavor, as one rank of an
expert-parallel group sees it, on fake tensors (no memory, no GPU), partition it as the builder
does, and report the activations its forward saves for the backward.

    python -m titan.builder.models.deepseek_v3.memory_report 671B --ep 64 --tokens 512
    python -m titan.builder.models.deepseek_v3.memory_report 671B --ep 64 --tokens 512 --capacity-factor 1.25

`--tokens` is what one rank routes per step: batch * seq_len, divided by tp under sequence
parallelism (671B at tp 8, seq 4096, batch 1: 512).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan.builder.models.deepseek_v3.config import FLAVORS
from titan.builder.models.moe.dispatch import DispatchPlan, make_plan
from titan.builder.models.deepseek_v3.moe import MoE


class _LayerStep(nn.Module):
    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x).float().sum()


def saved_activation_bytes(flavor: str, *, ep: int, tokens: int, capacity_factor: float | None = None,
                           dtype: torch.dtype = torch.bfloat16) -> tuple[DispatchPlan, int]:
    """(plan, bytes) that one MoE layer's forward saves for its backward on one rank, weights
    excluded. Initializes (and destroys) a fake process group of ep ranks."""
    cfg = FLAVORS[flavor]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ep)
    try:
        with torch.device("meta"):
            moe = MoE(cfg)
        for name in ("w1", "w2", "w3"):  # this rank's experts only
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(full.narrow(0, 0, full.shape[0] // ep)))
        step = _LayerStep(moe).to(dtype)
        moe.expert_bias.data = moe.expert_bias.float()
        moe.plan = make_plan(n_experts=cfg.n_routed_experts, ep=ep, tokens=tokens, top_k=cfg.top_k,
                             capacity_factor=capacity_factor)
        moe.ep_group = dist.group.WORLD if ep > 1 else None
        with FakeTensorMode(allow_non_fake_inputs=True):
            step.to_empty(device="cpu")
            x = torch.empty(1, tokens, cfg.dim, dtype=dtype, requires_grad=True)
        with contextlib.ExitStack() as stack:
            joint = aot_export_joint_with_descriptors(stack, step, (x,))
            fw, _ = min_cut_rematerialization_partition(joint.graph_module, None,
                                                        num_fwd_outputs=1)
            saved = next(n for n in fw.graph.nodes if n.op == "output").args[0][1:]
            # Weights (and views of them) are saved too, but they are held anyway.
            inputs = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in fw.graph.nodes
                      if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
            nbytes = sum(v.meta["val"].numel() * v.meta["val"].element_size() for v in saved
                         if isinstance(v.meta.get("val"), torch.Tensor)
                         and StorageWeakRef(v.meta["val"].untyped_storage()) not in inputs)
        return moe.plan, nbytes
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("flavor", choices=sorted(FLAVORS))
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--capacity-factor", type=float, default=None)
    args = parser.parse_args()
    plan, nbytes = saved_activation_bytes(args.flavor, ep=args.ep, tokens=args.tokens,
                                          capacity_factor=args.capacity_factor)
    cfg = FLAVORS[args.flavor]
    mode = "dropless" if plan.dropless else f"capacity factor {args.capacity_factor}"
    print(f"{args.flavor} ep={args.ep} tokens/rank={args.tokens} ({mode}): {plan.capacity} rows per peer block, "
          f"{plan.buffer_rows} rows per buffer; saved activations per MoE layer {nbytes / 2**30:.3f} GiB, "
          f"x {cfg.n_moe_layers} MoE layers = {nbytes * cfg.n_moe_layers / 2**30:.1f} GiB (bf16)")


if __name__ == "__main__":
    main()

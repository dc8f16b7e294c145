"""The plain-PyTorch reference rows of train_bench.py: what a user writes without a framework.

    python benchmarks/peer_ref.py --mode ref-eager|ref-compile --flavor 1B --layout single ...
    (one process per rank, launched by train_bench.py)

A Llama 3 written here (RMSNorm via F.rms_norm, RoPE on interleaved pairs, SDPA causal with
grouped-query heads, SwiGLU, untied output), the shapes of titan's flavors, trained on titan's
synthetic tokens. Parallelism and precision as PyTorch's own recipes do it:
- tensor parallel: DTensor `parallelize_module` with sequence parallel (norms sharded on the
  sequence, column-wise q/k/v/w1/w3, row-wise wo/w2, vocabulary-parallel output and loss);
- always FSDP2 `fully_shard` per block and at the root over the data-parallel mesh, with
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: fp32 master weights, bf16
  parameters and activations in the step, fp32 gradient reduction. With one data-parallel rank
  (world size 1, or tp alone) the mesh has one rank and FSDP2 only applies that policy, as
  torchtitan 0.3.0 does (the torchtitan rows do it at world size 1 too); this is the same policy
  as titan's bf16 artifacts (parameters cast to bf16).
- `torch.optim.AdamW(fused=True)`; with `--max-norm`, `clip_grad_norm_(foreach=True)` before it.
ref-compile: the same, each block `torch.compile(fullgraph=True)` before sharding.
On a pipeline layout (pp*), the same model cut into stages under torch.distributed.pipelining:
peer_ref_pipeline.py.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_worker import StepRecord, worker_args  # noqa: E402
from profile_steps import step_profiler_from_env  # noqa: E402
from bench_pipeline import bench_pipeline  # noqa: E402
from train_bench import LAYOUTS  # noqa: E402


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (batch, seq, heads, head_dim) in fp32, as Llama does."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2).type_as(x)


# Every projection of Llama is bias-free.
Linear = functools.partial(nn.Linear, bias=False)


class Attention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq, self.wk, self.wv = Linear(cfg.dim, q_width), Linear(cfg.dim, kv_width), Linear(cfg.dim, kv_width)
        self.wo = Linear(q_width, cfg.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallel each rank holds its share of the heads.
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        hidden = cfg.ffn_hidden
        self.w1, self.w2, self.w3 = Linear(cfg.dim, hidden), Linear(hidden, cfg.dim), Linear(cfg.dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PreNorm(nn.Module):
    """x + fn(RMSNorm(x)): each half of a pre-norm transformer block."""

    def __init__(self, cfg, fn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.fn = fn

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return x + self.fn(self.norm(x), *args)


class Block(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.attn = PreNorm(cfg, Attention(cfg))
        self.mlp = PreNorm(cfg, MLP(cfg))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x, cos, sin))


class Llama(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = Linear(cfg.dim, cfg.vocab_size)

    def init_weights(self, seq_len: int, device: torch.device) -> None:
        """After to_empty: parameters drawn (std 0.02, norms 1) and the RoPE tables."""
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)
        hd = self.cfg.head_dim
        freqs = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
        angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, self.cos, self.sin)
        return self.output(self.norm(h))


def tp_plan() -> dict:
    """Sequence parallel between the halves of each block: the norms run on a sequence shard,
    and the input of attention and of the MLP is gathered once, before its column-wise
    projections; the row-wise projections reduce-scatter back onto the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        "layers.*.*.norm": SequenceParallel(),
        "layers.*.attn.fn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                               desired_input_layouts=(Replicate(), None, None)),
        "layers.*.mlp.fn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.attn.fn.w[qkv]": ColwiseParallel(),
        "layers.*.attn.fn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.mlp.fn.w[13]": ColwiseParallel(),
        "layers.*.mlp.fn.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def build(mode: str, cfg, dp_shard: int, tp: int, seq_len: int, device: torch.device):
    """The sharded, initialized model and its meshes for this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device.type, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    with torch.device("meta"):
        model = Llama(cfg)
    if tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan())
    if mode == "ref-compile":
        for block in model.layers:
            block.compile(fullgraph=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp_shard"], mp_policy=mp)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(seq_len, device)
    return model, mesh


def run(mode: str, flavor: str, layout_name: str, batch: int, seq_len: int, steps: int, out: str, *,
        max_norm: float = 0.0, microbatches: int = 1) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    from titan.builder.models.llama3.config import FLAVORS
    from titan.runtime.data import SyntheticTokens

    on_gpu = torch.cuda.is_available()  # CPU (gloo) only to check this script
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    sizes = LAYOUTS[layout_name]
    dp_shard, tp = sizes.get("dp_shard", 1), sizes.get("tp", 1)
    cfg = FLAVORS[flavor]
    pipeline = bench_pipeline(layout_name, flavor=flavor, seq_len=seq_len, microbatches=microbatches)
    if pipeline is not None:
        from peer_ref_pipeline import run_pipeline
        record = StepRecord(device)
        run_pipeline(mode, cfg, pipeline, batch=batch, seq_len=seq_len, steps=steps, dp_shard=dp_shard, tp=tp,
                     device=device, max_norm=max_norm, record=record,
                     on_step=step_profiler_from_env(f"{layout_name}-{mode}", steps, dist.get_rank()))
        if dist.get_rank() == 0:
            record.write(out)
        dist.barrier()
        dist.destroy_process_group()
        return
    model, mesh = build(mode, cfg, dp_shard, tp, seq_len, device)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    dp_rank = mesh["dp_shard"].get_local_rank()
    data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=batch, seq_len=seq_len, seed=0, dp_rank=dp_rank)
    global_tokens = float(batch * seq_len * dp_shard)
    record = StepRecord(device)
    on_step = step_profiler_from_env(f"{layout_name}-{mode}", steps, dist.get_rank())
    for step in range(steps):
        tokens, labels = (t.to(device) for t in data.batch(step))
        record.start()
        with loss_parallel() if tp > 1 else torch.enable_grad():
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / global_tokens
            loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        reported = loss.detach()
        reported = reported.full_tensor() if hasattr(reported, "full_tensor") else reported.clone()
        if dp_shard > 1:  # the mean loss over the global batch
            dist.all_reduce(reported, group=mesh["dp_shard"].get_group())
        record.stop(reported.item())
        if on_step is not None:
            on_step(step + 1)
    if dist.get_rank() == 0:
        record.write(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    a = worker_args(["ref-eager", "ref-compile"])
    run(a.mode, a.flavor, a.layout, a.batch_size, a.seq_len, a.steps, a.json, max_norm=a.max_norm,
        microbatches=a.microbatches)

if __name__ == "__main__":
    main()

"""An independent plain Llama 3, trained the way a user writes it: one GPU, no framework.

    python benchmarks/plain_llama.py [--flavor 1B] [--seq-len 2048] [--batch-size 1] [--steps 12]
        [--compile none|blocks] [--inductor-cache fresh|DIR] [--max-norm 1.0] [--json out.json]
        [--device cuda|cpu]

The benchmark's anchor for "what torch.compile gives a user" (issue 30): nothing here imports
titan, and nothing is tuned for titan's benefit or against it. The model is Llama 3 as Meta's
reference writes it (RMSNorm in fp32, RoPE on interleaved pairs, grouped-query attention through
`F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on its default backend,
SwiGLU), with the shapes of the other rows (titan's `1B` is Llama 3.2 1B with an untied output,
as every row of the table trains it; `--tie-embeddings` ties it as the published 1B does).

Training as the other rows do: fp32 parameters and AdamW state, bf16 compute under
`torch.autocast`, `torch.optim.AdamW(fused=True)` with lr 8e-4, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1, cross-entropy over fp32 logits averaged over the batch's tokens, with
`--max-norm` a foreach `clip_grad_norm_` before the optimizer; uniform random tokens of the
same batch shape. `--compile blocks` compiles each transformer block (`module.compile(
fullgraph=True)`, as torchtitan does); embedding, final norm, output and loss stay eager.

Timing, as every row of benchmarks/train_bench.py: the device synchronized around each step;
steady tokens/s from the median step of steps 3..N; the first step's end in seconds from the
process's launch (BENCH_T0 when train_bench launched it, else this process's start from /proc).
`--inductor-cache fresh` points inductor's and Triton's caches at a new empty directory (a cold
compile); `--inductor-cache DIR` at DIR (run twice: the second run is a warm compile). As a
train_bench row (`--mode plain-eager|plain-compile`, launched with the peers' command line) it
writes the peers' JSON record and profiles its last two steps under BENCH_PROFILE.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

T_IMPORTED = time.time()


def process_start_time() -> float:
    """Unix time at which this process started (Linux /proc; elsewhere: now)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return time.time()


T_LAUNCH = float(os.environ.get("BENCH_T0") or process_start_time())
"""The row's launch: set by train_bench.py before it starts the process, else this process's start."""


@dataclass(kw_only=True, frozen=True)
class Shape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Meta's published Llama 3 shapes (ffn_hidden as their multiple_of / ffn_dim_multiplier give it).
SHAPES = {
    "debug": Shape(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_hidden=704),
    "1B": Shape(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=8192),
    "8B": Shape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="1B", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--compile", choices=["none", "blocks"], default=None,
                   help="per-block torch.compile or none (default: from --mode, else none)")
    p.add_argument("--mode", default=None, help="the row's name in train_bench.py (plain-eager, plain-compile)")
    p.add_argument("--layout", default="single", help="train_bench's layout: only 'single' (one GPU)")
    p.add_argument("--inductor-cache", default=None,
                   help="'fresh': a new empty inductor + Triton cache (cold compile); DIR: that directory")
    p.add_argument("--max-norm", type=float, default=0.0, help="clip gradients to this global norm (0: no clip)")
    p.add_argument("--tie-embeddings", action="store_true", help="share the embedding and output weights")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--json", default=None, help="write the step record here (train_bench's peer format)")
    a = p.parse_args()
    if a.layout != "single":
        p.error(f"--layout {a.layout}: the plain model runs on one device only (--layout single)")
    if a.compile is None:
        a.compile = "blocks" if a.mode and "compile" in a.mode else "none"
    a.mode = a.mode or f"plain-{'compile' if a.compile == 'blocks' else 'eager'}"
    return a


def point_compiler_caches(where: str) -> str:
    """Inductor's and Triton's caches in one directory (read at the first compile, not at import)."""
    root = tempfile.mkdtemp(prefix="plain-llama-cache-") if where == "fresh" else where
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    return root


# ------------------------------------------------------------------------------------------
# the model

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs (x[2i], x[2i+1]) of x (batch, seq, heads, head_dim), in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.n_heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * shape.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), cos, sin).transpose(1, 2)
        k = rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.ffn_hidden, bias=False)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.feed_forward = FeedForward(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, shape: Shape, *, max_seq_len: int, tie_embeddings: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList(TransformerBlock(shape) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.dim, shape.norm_eps)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        hd = shape.head_dim
        freqs = 1.0 / shape.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if not name.endswith("norm.weight"):
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for block in self.layers:
            h = block(h, cos, sin)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------------------------
# training

def main() -> None:
    args = parse_args()
    cache_root = point_compiler_caches(args.inductor_cache) if args.inductor_cache else None
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_worker import StepRecord  # the other rows' step timing and JSON record
    from profile_steps import step_profiler_from_env

    os.environ.setdefault("BENCH_T0", str(T_LAUNCH))
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"error: --device {name}: no CUDA GPU is visible here; use --device cpu")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if name == "cuda" else name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = SHAPES[args.flavor]
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(shape, max_seq_len=args.seq_len, tie_embeddings=args.tie_embeddings)
    if args.compile == "blocks":
        for block in model.layers:
            block.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    t_built = time.time()
    data = torch.Generator().manual_seed(0)
    record = StepRecord(device)
    on_step = step_profiler_from_env(f"{args.layout}-{args.mode}", args.steps, 0)
    for step in range(args.steps):
        batch = torch.randint(0, shape.vocab_size, (args.batch_size, args.seq_len + 1), generator=data)
        tokens, labels = batch[:, :-1].to(device), batch[:, 1:].to(device)
        record.start()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        if args.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.stop(loss.item())
        if on_step is not None:
            on_step(step + 1)
    if args.json:
        record.write(args.json, import_s=T_IMPORTED - T_LAUNCH, setup_s=t_built - T_IMPORTED)
    timed = sorted(record.times[2:] or record.times[-1:])
    step_s = timed[len(timed) // 2]
    print(f"{args.mode}: {args.flavor} seq {args.seq_len} batch {args.batch_size} on {device.type}: "
          f"{args.batch_size * args.seq_len / step_s:,.0f} tok/s (median of steps 3..{args.steps}); "
          f"first step ends {record.first_step_s:.1f} s after launch (torch imported {T_IMPORTED - T_LAUNCH:.1f} s, "
          f"model and optimizer {t_built - T_IMPORTED:.1f} s, first step {record.times[0]:.1f} s); "
          f"losses {[round(x, 3) for x in record.losses[:3]]}"
          + (f"; compiler caches {cache_root}" if cache_root else ""), flush=True)


if __name__ == "__main__":
    main()

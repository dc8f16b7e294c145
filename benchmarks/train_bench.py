"""Side-by-side training benchmark on one GPU host: eager PyTorch, torch.compile per
transformer block (as torchtitan does), and titan-run from a built artifact; same model,
layout, batch shape, precision policy (bf16 compute, fp32 master weights and optimizer state,
fp32 gradient reduction) and data.

    python benchmarks/train_bench.py --layout tp4 --layout fsdp4 [--flavor 8B] [--seq-len 8192]
        [--steps 12] [--modes eager,compile,compile-warm,titan] [--json results.json]

eager:   DTensor TP (with sequence parallel; DTensor parameters, bf16 autocast) for tp; FSDP2
         fully_shard per block with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
         for fsdp; torch.optim.AdamW defaults (foreach).
compile: the same, each transformer block torch.compile'd; 'compile' starts from an empty
         inductor cache, 'compile-warm' reuses it.
titan:   titan-build (outside the timed run; a cache hit when built before), then titan-run
         with the default passes (bit-exact with eager) and CUDA graphs. Ablation rows
         (TITAN_VARIANTS): titan-nopass (no bucketing, no overlap, no exact fusion),
         titan-bucket (FSDP bucketing alone), titan-overlap (reordering alone), titan-noexact
         (the default passes but fuse_exact), titan-nocg (default passes, no CUDA graphs), titan-opbyop (AdamW op by op, not one kernel);
         titan-kernels builds with --kernels (the exact regions' kernels compiled at build time
         and shipped in the artifact: the run loads them, compiling nothing);
         titan-fuse / titan-fuse-regions use the numerics-changing fusion (titan-build --fuse);
         titan-flex / titan-flex-doc: FlexAttention, causal / document mask (--eos-id from
         TITAN_BENCH_EOS).

Peer rows (PEER_MODES), same shapes, precision policy and data, each in its own processes:
ref-eager / ref-compile: a plain-PyTorch Llama 3 (FSDP2 + DTensor TP, fused AdamW, per-block
         torch.compile for ref-compile) written in benchmarks/peer_ref.py;
plain-eager / plain-compile: an independent plain Llama 3 that imports nothing of titan, written
         as a user would (benchmarks/plain_llama.py: bf16 autocast, fused AdamW, per-block
         torch.compile for plain-compile); one GPU only (layout single);
tt-eager / tt-compile / tt-toolkit: torchtitan 0.2.2's trainer, its torch.compile, and its
         compiler toolkit (the whole forward + backward traced, CUDA graphs; 0.2.2's predecessor
         of the graph trainer, which needs a torch newer than 2.11); tt-toolkit-nocg: without
         its CUDA graphs (benchmarks/peer_torchtitan.py; wheels in benchmarks/peer_wheels.txt).
A row that cannot run says why (the last error line of its rank 0), and the table goes on.
Pipeline layouts (pp2, pp2-zbv, pp2-tp2, pp4, ...): every row on one schedule, --microbatches and
stage split (bench_pipeline.py; eager, ref-* and tt-* under torch.distributed.pipelining).

Per row: tokens/s/GPU (median step over steps 3..N), MFU against 989 TFLOP/s and against a
bf16 matmul rate measured here, time from process start to the end of the first step,
process wall time, peak GPU memory (rank 0), and ratios to eager, to compile and to the best
peer row of the same layout (the fastest of PEER_MODES that ran).
BENCH_ROW_TIMEOUT=S: a row still running after S seconds is stopped and reported as timed out.
TITAN_BENCH_DATA=FILE (a titan-data token file): every row trains on it (titan rows with --data,
peer rows read the same windows) instead of synthetic tokens: documents for the flex rows.
BENCH_PROFILE=DIR: rank 0 of each row also profiles its last two steps (profile_steps.py) and
prints where the GPU time went; those two steps are slower and drop out of the median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEAK_TFLOPS = 989.0
LAYOUTS = {"tp4": dict(tp=4), "fsdp4": dict(dp_shard=4), "tp2": dict(tp=2), "fsdp2": dict(dp_shard=2),
           "dp2tp2": dict(dp_shard=2, tp=2), "tp2dp2": dict(dp_shard=2, tp=2),
           "dp2tp4": dict(dp_shard=2, tp=4), "single": dict(),
           # pipelines (their schedules: bench_pipeline.PP_SCHEDULES)
           "pp2": dict(pp=2), "pp2-gpipe": dict(pp=2), "pp2-interleaved": dict(pp=2), "pp2-zbv": dict(pp=2),
           "pp2-tp2": dict(pp=2, tp=2), "pp2-fsdp2": dict(pp=2, dp_shard=2), "pp4": dict(pp=4), "pp4-zbv": dict(pp=4)}


def mesh_flags(sizes: dict) -> list[str]:
    """titan-build's flags for a layout's mesh sizes (`--pp 2 --tp 2`)."""
    return [flag for k, v in sizes.items() for flag in (f"--{k.replace('_', '-')}", str(v))]


def _defaults_but(*dropped: str):
    """titan-build flags for the layout's default passes without `dropped`."""
    def flags(layout: dict) -> list[str]:
        from titan.builder.passes.registry import default_passes
        return ["--passes", ",".join(p for p in default_passes(layout) if p not in dropped)]
    return flags


# mode -> (extra titan-build flags, or a function of the layout's mesh sizes giving them;
#          extra titan-run flags; needs FSDP)
TITAN_VARIANTS = {
    "titan": ([], [], False),
    "titan-noexact": (_defaults_but("fuse_exact"), [], False),
    "titan-nopass": (["--passes", "mask_index_put_to_where"], [], False),
    "titan-bucket": (["--passes", "mask_index_put_to_where,bucket_all_gather,bucket_reduce_scatter"], [], True),
    "titan-overlap": (["--passes", "mask_index_put_to_where,overlap_collectives"], [], False),
    "titan-nocg": ([], ["--no-cuda-graphs"], False),
    "titan-opbyop": ([], ["--no-fused-adamw"], False),
    "titan-kernels": (["--kernels"], [], False),
    "titan-fuse": (["--fuse"], [], False),
    "titan-fuse-regions": (["--fuse", "regions"], [], False),
    "titan-flex": (["--attention", "flex"], [], False),
    "titan-flex-doc": (lambda layout: ["--attention", "flex", "--mask", "document",
                                       "--eos-id", os.environ["TITAN_BENCH_EOS"]], [], False),
}

# peer mode -> its worker script (in benchmarks/)
PEER_MODES = {"ref-eager": "peer_ref.py", "ref-compile": "peer_ref.py",
              "plain-eager": "plain_llama.py", "plain-compile": "plain_llama.py",
              **{m: "peer_torchtitan.py" for m in ("tt-eager", "tt-compile", "tt-toolkit", "tt-toolkit-nocg",
                                                   "tt-compile-flex")}}


def flops_per_token(cfg, seq_len: int) -> float:
    """6 x non-embedding parameters + attention (torchtitan's estimate)."""
    d, f, hd = cfg.dim, cfg.ffn_hidden, cfg.head_dim
    per_layer = 2 * d * d + 2 * d * cfg.n_kv_heads * hd + 3 * d * f + 2 * d
    non_embedding = cfg.n_layers * per_layer + d + cfg.vocab_size * d
    return 6 * non_embedding + 12 * cfg.n_layers * cfg.n_heads * hd * seq_len


# --------------------------------------------------------------------------------------------
# worker (one rank of eager / compile)

def worker(mode: str, flavor: str, layout_name: str, batch: int, seq_len: int, steps: int, out: str, *,
           max_norm: float = 0.0, microbatches: int = 1) -> None:
    if "pp" in LAYOUTS[layout_name]:
        from bench_eager_pipeline import eager_pipeline_worker
        eager_pipeline_worker(mode, flavor, layout_name, batch, seq_len, steps, out, max_norm=max_norm,
                              microbatches=microbatches)
        return
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from titan.cli.tools.eager import materialize_shards
    from titan.runtime.contract.layout import Layout
    from titan.builder.models import model_spec
    from titan.builder.trace.parallelize import parallelize
    from titan.runtime.data import SyntheticTokens
    from titan.runtime.init import full_param

    from bench_worker import StepRecord, global_loss, join_ranks, leave

    rank, device = join_ranks()
    llama3 = model_spec("llama3")
    cfg = llama3.flavors[flavor]
    layout = Layout(**LAYOUTS[layout_name])
    specs = llama3.init_specs(cfg)
    with torch.device("meta"):
        model = llama3.build(cfg)
    model.loss_scale = float(batch * seq_len * layout.dp_degree)
    autocast = False
    if layout.dp_shard > 1 and layout.tp == 1:
        mesh = init_device_mesh(device.type, (layout.dp_shard,), mesh_dim_names=("dp_shard",))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.to_empty(device=device)
        with torch.no_grad():
            for fqn, p in model.named_parameters():
                full = full_param(specs[fqn], list(p.shape), fqn=fqn, seed=0, device=device)
                p.to_local().copy_(full.chunk(layout.dp_shard, 0)[dist.get_rank()])
        dp_rank = rank
    elif layout.dp_degree == 1:
        # Tensor parallel as users run it: DTensor parameters from the TP plan, bf16 autocast.
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh(device.type, (layout.tp,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, llama3.tp_plan(model))
        model.to_empty(device=device)
        with torch.no_grad():
            for fqn, p in model.named_parameters():
                full = full_param(specs[fqn], list(p.shape), fqn=fqn, seed=0, device=device)
                (pl,) = p.placements
                local = full.chunk(layout.tp, pl.dim)[rank] if pl.is_shard() else full
                p.to_local().copy_(local)
        dp_rank = 0
        autocast = True
    else:
        mesh = layout.build_mesh(device.type)
        coords = layout.coordinates(rank)
        shards = parallelize(model, layout, mesh, coords, tp_plan=llama3.tp_plan, compute_dtype=torch.bfloat16)
        materialize_shards(model, shards, specs, seed=0, device=device)
        dp_rank = layout.dp_rank(coords)
    if mode.startswith("compile"):
        import torch._dynamo
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for block in model.layers.values():
            block.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=batch, seq_len=seq_len, seed=0, dp_rank=dp_rank)
    record = StepRecord(device)
    from profile_steps import step_profiler_from_env
    on_step = step_profiler_from_env(f"{layout_name}-{mode}", steps, rank)
    for step in range(steps):
        tokens, labels = (t.to(device) for t in data.batch(step))
        record.start()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels)
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.stop(global_loss(loss, layout, mesh).item())
        if on_step is not None:
            on_step(step + 1)
    leave(record, rank, out)


# --------------------------------------------------------------------------------------------
# launcher

class RowFailed(Exception):
    """A row's processes failed or ran out of time; the message says why."""


def failure_reason(log: Path) -> str:
    """The last line of a rank's output that names an error, else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error:" in ln or "Error(" in ln or "Exception:" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def _spawn(cmd: list[str], world: int, env_extra: dict, log_prefix: Path) -> float:
    """Run `cmd` as `world` ranks; each rank's output goes to LOG_PREFIX.rankN.log, and rank 0's
    is echoed when the row ends."""
    t0 = time.time()
    port = 29500 + os.getpid() % 1000
    timeout = float(os.environ.get("BENCH_ROW_TIMEOUT", "0"))
    procs, logs = [], []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), BENCH_T0=str(t0), **env_extra)
        log = Path(f"{log_prefix}.rank{r}.log")
        logs.append(log)
        with log.open("w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    # One failed rank leaves its peers waiting in a collective: stop them.
    timed_out = False
    while any(p.poll() is None for p in procs):
        if timeout and time.time() - t0 > timeout:
            timed_out = True
        if timed_out or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.5)
    codes = [p.wait() for p in procs]
    print(logs[0].read_text(errors="replace"), end="", flush=True)
    if timed_out:
        raise RowFailed(f"timed out after {timeout:.0f} s (BENCH_ROW_TIMEOUT)")
    if any(codes):
        # The rank that failed on its own, not one stopped here (negative: killed by a signal).
        failed = next((i for i, c in enumerate(codes) if c > 0), next(i for i, c in enumerate(codes) if c))
        raise RowFailed(f"exit codes {codes}: {failure_reason(logs[failed])}")
    return time.time() - t0


def matmul_tflops() -> float:
    import torch
    if not torch.cuda.is_available():
        return float("nan")
    code = ("import torch,time;a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16);b=torch.randn_like(a)\n"
            "for _ in range(3): a@b\n"
            "torch.cuda.synchronize();t=time.perf_counter()\n"
            "for _ in range(20): a@b\n"
            "torch.cuda.synchronize();print(20*2*8192**3/(time.perf_counter()-t)/1e12)")
    return float(subprocess.check_output([sys.executable, "-c", code], text=True).strip())


def run_mode(mode: str, layout: str, opts, tmp: Path, *, pipeline=None) -> dict:
    """One row; `pipeline` (a bench_pipeline.BenchPipeline) for a pipeline layout."""
    world = math.prod(LAYOUTS[layout].values())
    result_file = tmp / f"{layout}-{mode}.json"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
    if mode == "compile":
        shutil.rmtree(tmp / "inductor", ignore_errors=True)
    if mode in TITAN_VARIANTS:
        build_flags, run_flags, _ = TITAN_VARIANTS[mode]
        art = tmp / f"{mode}-{layout}"
        build = [sys.executable, "-m", "titan.cli.build", "--flavor", opts.flavor, "--seq-len", str(opts.seq_len),
                 "--batch-size", str(opts.batch_size), "--dtype", "bf16", "--out", str(art)]
        build += build_flags(LAYOUTS[layout]) if callable(build_flags) else build_flags
        build += mesh_flags(LAYOUTS[layout]) + (pipeline.titan_flags() if pipeline else [])
        if opts.flavor == "debug":
            build[build.index("bf16")] = "fp32"  # CPU smoke test
        built = subprocess.run(build, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if built.returncode:
            raise RowFailed(f"titan-build exit {built.returncode}: {(built.stderr.strip().splitlines() or [''])[-1][:300]}")
        metrics = tmp / f"{layout}-{mode}.jsonl"
        t0 = time.time()
        if os.environ.get("BENCH_PROFILE"):
            run = [sys.executable, str(Path(__file__).parent / "profile_steps.py"), str(art), "--steps", str(opts.steps),
                   "--metrics", str(metrics), "--out", os.environ["BENCH_PROFILE"], "--label", f"{layout}-{mode}",
                   *run_flags]
        else:
            # Steady state is measured on the kernels: a first run on this host waits for them.
            run = [sys.executable, "-m", "titan.cli.run", str(art), "--steps", str(opts.steps),
                   "--metrics", str(metrics), "--no-compile-in-background", *run_flags]
        if os.environ.get("TITAN_BENCH_DATA"):
            run += ["--data", os.environ["TITAN_BENCH_DATA"]]
        if opts.max_norm > 0:
            run += ["--max-norm", str(opts.max_norm)]
        wall = _spawn(run, world, env, tmp / f"{layout}-{mode}")
        recs = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]  # after the config header
        res = {"step_times": [r["step_time_s"] for r in recs], "losses": [r["loss"] for r in recs],
               "first_step_s": recs[0]["time"] - t0, "peak_gib": recs[-1].get("peak_mem_gib", 0.0)}
    else:
        worker = ([str(Path(__file__).parent / PEER_MODES[mode]), "--mode", mode] if mode in PEER_MODES
                  else [__file__, "--worker", mode])
        wall = _spawn([sys.executable, *worker, "--flavor", opts.flavor, "--layout", layout,
                       "--batch-size", str(opts.batch_size), "--seq-len", str(opts.seq_len),
                       "--steps", str(opts.steps), "--json", str(result_file), "--max-norm", str(opts.max_norm),
                       # Only a pipeline row splits its step (plain_llama.py runs one GPU, no pipeline).
                       *(["--microbatches", str(opts.microbatches)] if "pp" in LAYOUTS[layout] else [])],
                      world, env, tmp / f"{layout}-{mode}")
        res = json.loads(result_file.read_text())
    res["wall_s"] = wall
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", default=None)
    p.add_argument("--layout", action="append")
    p.add_argument("--flavor", default="8B")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--microbatches", type=int, default=8,
                   help="pipeline layouts (pp*): micro-batches of --batch-size sequences per step, in every row")
    p.add_argument("--modes", default="eager,compile,compile-warm,titan")
    p.add_argument("--json", default=None)
    p.add_argument("--max-norm", type=float, default=1.0,
                   help="every row clips gradients to this global norm, torchtitan's default (0: no row clips)")
    opts = p.parse_args()
    if opts.worker:
        worker(opts.worker, opts.flavor, opts.layout[0], opts.batch_size, opts.seq_len, opts.steps, opts.json,
               max_norm=opts.max_norm, microbatches=opts.microbatches)
        return
    from titan.builder.models.llama3.config import FLAVORS
    from bench_pipeline import bench_pipeline
    from bench_table import print_table, with_ratios
    cfg = FLAVORS[opts.flavor]
    fpt = flops_per_token(cfg, opts.seq_len)
    measured = matmul_tflops()
    rows, pipelines = [], {}

    def save() -> None:  # after every row: a run cut short still leaves what it measured
        if opts.json:
            Path(opts.json).write_text(json.dumps({
                "rows": [(layout, with_ratios(results, PEER_MODES)) for layout, results in rows],
                "matmul_tflops": measured, "flavor": opts.flavor, "seq_len": opts.seq_len,
                "batch_size": opts.batch_size, "steps": opts.steps, "microbatches": opts.microbatches,
                "pipelines": pipelines}, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        for layout in opts.layout or ["tp4", "fsdp4"]:
            world = math.prod(LAYOUTS[layout].values())
            dp = LAYOUTS[layout].get("dp_shard", 1)
            # A pipeline step reads --microbatches micro-batches of --batch-size per data-parallel rank.
            sequences = opts.batch_size * (opts.microbatches if "pp" in LAYOUTS[layout] else 1)
            results = {}
            rows.append((layout, results))
            try:
                pipeline = bench_pipeline(layout, flavor=opts.flavor, seq_len=opts.seq_len,
                                          microbatches=opts.microbatches)
            except ValueError as e:
                print(f"{layout}: cannot run ({e})", flush=True)
                results.update({mode: {"failed": str(e)} for mode in opts.modes.split(",")})
                continue
            if pipeline:
                pipelines[layout] = pipeline.describe()
                print(f"{layout}: pipeline {pipeline.describe()}, every row", flush=True)
            for mode in opts.modes.split(","):
                if TITAN_VARIANTS.get(mode, (None, None, False))[2] and dp < 2:
                    continue  # FSDP-only ablation row
                try:
                    r = run_mode(mode, layout, opts, Path(tmp), pipeline=pipeline)
                except (RowFailed, FileNotFoundError, json.JSONDecodeError) as e:
                    print(f"{layout} {mode}: FAILED ({e})", flush=True)
                    results[mode] = {"failed": str(e)}
                    save()
                    continue
                timed = r["step_times"][:-2] if os.environ.get("BENCH_PROFILE") else r["step_times"]
                step = statistics.median(timed[2:]) if len(timed) > 2 else timed[-1]
                tps = sequences * opts.seq_len * dp / step / world
                results[mode] = dict(r, tokens_per_s_per_gpu=tps, mfu=tps * fpt / (PEAK_TFLOPS * 1e12),
                                     mfu_measured=tps * fpt / (measured * 1e12))
                print(f"{layout} {mode}: {tps:,.0f} tok/s/GPU, first step {r['first_step_s']:.1f} s, "
                      f"wall {r['wall_s']:.1f} s, peak {r['peak_gib']:.1f} GiB, losses {r['losses'][:3]}", flush=True)
                save()
    print(f"\nbf16 matmul 8192^3 measured: {measured:.0f} TFLOP/s; model {opts.flavor}, seq {opts.seq_len}, "
          f"batch {opts.batch_size}; throughput = median step of steps 3..{opts.steps}")
    for layout, text in pipelines.items():
        print(f"{layout}: {text}")
    print_table([(layout, with_ratios(results, PEER_MODES)) for layout, results in rows])

if __name__ == "__main__":
    main()

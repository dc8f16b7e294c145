"""titan-run: train from an artifact on every rank.

One run path: the options are parsed once into a RunConfig, and runtime/run_state.py checks them
against the artifact (and the checkpoint) on every rank, whether titan-run spawned it or torchrun
did. Without RANK set, titan-run first makes the same checks once, so that a mistake is one line
before any rank starts, then spawns the artifact's world size of local ranks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import TYPE_CHECKING

import click

from titan.cli.errors import Command
from titan.cli.options import kernel_trust, kernel_trust_options, LEARNING_RATE, NON_NEGATIVE, POSITIVE, SEED, TIMEOUT, NonEmptyPath, command_args
from titan.runtime.common import interrupt
from titan.runtime.startup import Phases, job_started

if TYPE_CHECKING:
    from titan.runtime.contract.manifest import Manifest


@click.command(cls=Command)
@click.argument("artifact", type=NonEmptyPath(file_okay=False))
@click.option("--steps", default=20, show_default=True, type=NON_NEGATIVE,
              help="Train up to this step (counted from the start, also when resuming); 0 with --checkpoint-dir "
                   "only checkpoints the initial weights.")
@click.option("--lr", default=8e-4, show_default=True, type=LEARNING_RATE, help="AdamW learning rate (> 0).")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed for initial weights and synthetic data.")
@click.option("--batch-size", default=None, type=POSITIVE, help="Must equal the artifact's (it shapes the graphs).")
@click.option("--seq-len", default=None, type=POSITIVE, help="Must equal the artifact's (it shapes the graphs).")
@click.option("--data", default=None, type=NonEmptyPath(dir_okay=False),
              help="Flat token file written by titan-data (default: synthetic tokens).")
@click.option("--data-dtype", default=None, type=click.Choice(["uint16", "uint32"]),
              help="Token file element type (default: from its titan-data sidecar, else uint16).")
@click.option("--metrics", default=None, type=NonEmptyPath(dir_okay=False),
              help="Write one JSON object per step to this new file (--resume rewrites it from the checkpoint's step).")
@click.option("--tensorboard", default=None, type=NonEmptyPath(file_okay=False),
              help="Write TensorBoard scalars (loss, tokens/s, step time, GPU peak memory) into this directory.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
              help="Where the ranks run: cpu (gloo), cuda (one GPU per rank, nccl) or auto (cuda when the host has a GPU per rank).")
@click.option("--deterministic", is_flag=True, help="Deterministic kernels only (GPU).")
@click.option("--timeout", "timeout_s", default=300.0, show_default=True, type=TIMEOUT,
              help="Seconds a rank waits in a collective (or for its peers) before the job fails.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="On GPU, capture forward + backward in a CUDA graph and replay it.")
@click.option("--fused-adamw/--no-fused-adamw", default=True, show_default=True,
              help="On GPU, one AdamW kernel per parameter (bitwise the op-by-op update; needs triton).")
@click.option("--init-from-hf", default=None, type=NonEmptyPath(file_okay=False),
              help="Load the initial weights from a Hugging Face Llama directory (config.json + safetensors).")
@click.option("--checkpoint-dir", default=None, type=NonEmptyPath(file_okay=False),
              help="Write DCP checkpoints (step-NNNNNNNN/ directories) here, at the last step.")
@click.option("--checkpoint-every", default=None, type=POSITIVE, help="Also checkpoint every K steps.")
@click.option("--resume", is_flag=True, help="Continue from the latest complete checkpoint in --checkpoint-dir.")
@click.option("--resume-with-changes", is_flag=True,
              help="With --resume: accept a --seed, --data or --lr other than the checkpoint's.")
@kernel_trust_options
def main(artifact, steps, lr, seed, batch_size, seq_len, data, data_dtype, metrics, tensorboard, device, deterministic,
         timeout_s, cuda_graphs, fused_adamw, init_from_hf, checkpoint_dir, checkpoint_every, resume,
         resume_with_changes, trust_keys, trust_unsigned_kernels):
    """Train from ARTIFACT (a directory written by titan-build)."""
    import titan.runtime.common.compiler_caches as compiler_caches
    compiler_caches.ensure()  # regions may compile: the compilers' caches must be private first
    trust = kernel_trust(trust_keys, trust_unsigned_kernels)
    if resume_with_changes and not resume:
        raise ValueError("--resume-with-changes only applies with --resume")
    launcher = "RANK" not in os.environ  # else one rank: spawned by the launcher below, or by torchrun
    if launcher and checkpoint_dir is not None:
        # Registered before the ranks' stop (spawn_local), so it runs after it on a signal.
        interrupt.on_interrupt(lambda: _where_to_resume(checkpoint_dir))
    if launcher:
        t0 = job_started()
        options = dict(steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
                       init_from_hf=init_from_hf)
        art = _announce(artifact, device, options=options, data=data, checkpoint_dir=checkpoint_dir, resume=resume,
                        init_from_hf=init_from_hf, metrics=metrics, tensorboard=tensorboard)
        phases = Phases(click.echo)
        checking = phases("checking the artifact's files and the run's options (importing torch first)")
    else:
        from titan.runtime.startup import rank_phases
        checking = rank_phases()(f"rank {os.environ['RANK']}: importing torch", short="torch import")
    with checking:
        from titan.runtime.train import RunConfig

        cfg = RunConfig(steps=steps, lr=lr, seed=seed, batch_size=batch_size, seq_len=seq_len, data=data,
                        data_dtype=data_dtype, metrics=metrics, tensorboard=tensorboard, device=device,
                        deterministic=deterministic, cuda_graphs=cuda_graphs, fused_adamw=fused_adamw,
                        timeout_s=timeout_s, init_from_hf=init_from_hf, checkpoint_dir=checkpoint_dir,
                        checkpoint_every=checkpoint_every, resume=resume, resume_with_changes=resume_with_changes,
                        kernel_trust=trust)
        if launcher:
            origin = check_run(art, cfg)
    if not launcher:
        from titan.runtime.distributed import exit_rank
        from titan.runtime.train import rank_main
        exit_rank(rank_main(artifact, cfg))
    click.echo(f"start: {origin}")
    sys.exit(launch(art, cfg, started=t0))


def _announce(artifact: str, device: str, *, options: dict, **paths):
    """Open the artifact, make the checks that need no torch (the files the options name, the
    memory the ranks need), and say what the run is (and how long its start took last time)."""
    from titan.runtime.common import timings
    from titan.runtime.contract.artifact import open_artifact
    from titan.runtime.run_paths import check_option_combinations, check_run_paths

    art = open_artifact(artifact)
    check_option_combinations(**options)
    check_run_paths(**paths)
    warning = check_memory(art, device)
    m = art.manifest
    last = timings.last("run-start", run_start_key(m, device))
    click.echo(f"titan-run {art.root}: {describe_build(m)}"
               + ("" if last is None else f" (step 1 came {last:.1f} s after start last time)"))
    if warning:
        click.echo(f"warning: {warning}")
    return art


def describe_build(manifest: Manifest) -> str:
    """'llama3 debug, 2 rank(s) [tp2], batch 2 x seq 128, float32'."""
    return (f"{manifest.model} {manifest.flavor}, {manifest.world_size} rank(s) [{manifest.layout.tag()}], "
            f"batch {manifest.batch_size} x seq {manifest.seq_len}, {manifest.dtype}")


def check_memory(art, device: str) -> str | None:
    """Refuse a job whose ranks cannot fit this host's memory (on GPU: one GPU's); returns a
    warning when they only exceed what is free now."""
    from titan.runtime.memory_fit import check_fits, gpu_memory

    gpu = device == "cuda" or (device == "auto" and gpu_memory() is not None)
    return check_fits([art.rank_record(0)] * art.world_size, gpu=gpu)


def run_start_key(manifest: Manifest, device: str) -> str:
    """Names a run's start-up time: the build and the --device asked for."""
    return f"{manifest.cache_key}-{device}"


def check_run(art, cfg) -> str:
    """The checks every rank will make, made once before any starts; returns what the run
    starts from (for its `start:` line)."""
    from titan.runtime.run_state import RunState

    art.verify_all()
    record = art.rank_record(0)
    state = RunState(cfg, art.manifest, record.params, buffers=record.buffers)  # every rank's checks, once
    state.close()
    for note in state.notes:
        click.echo(note)
    if cfg.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        from titan.runtime.step_log import TENSORBOARD_HINT
        raise ValueError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}")
    if cfg.device != "cpu":
        _check_gpus(art.world_size, cfg.device)
    from titan.runtime.memory_estimate import check_local_ranks
    check_local_ranks(art.world_size, record, cfg.device, name=str(art.root))  # a CPU host's cores and memory
    return state.origin()


def launch(art, cfg, *, started: float) -> int:
    """Spawn the run's ranks on this host; returns the job's exit code."""
    from titan.runtime.launch import spawn_local
    from titan.runtime.startup import SPAWNED_ENV, STARTED_ENV

    click.echo(f"starting {art.world_size} rank(s)")
    os.environ[STARTED_ENV] = repr(started)  # rank 0 records the start-up time from here
    os.environ[SPAWNED_ENV] = repr(time.time())
    return spawn_local("titan.cli.run", command_args(), art.world_size)


def _where_to_resume(checkpoint_dir: str) -> None:
    """On a signal, once the ranks are stopped: remove a cut save, and say where the last
    checkpoint is and how to continue from it."""
    from titan.runtime.checkpoint_dirs import complete_steps, remove_partial_saves, step_path

    remove_partial_saves(checkpoint_dir)
    steps = complete_steps(checkpoint_dir)
    if steps:
        print(f"last checkpoint: {step_path(checkpoint_dir, steps[-1])} (step {steps[-1]}); the same command with "
              "--resume continues from it", flush=True)
    else:
        print(f"no checkpoint was completed in {checkpoint_dir}: a new run starts from step 0", flush=True)


def _check_gpus(world_size: int, device: str) -> None:
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and count < world_size:
        raise ValueError(f"the artifact has {world_size} ranks but this host has {count} GPU(s); "
                         "launch with torchrun across hosts, or use --device cpu")


if __name__ == "__main__":
    main()

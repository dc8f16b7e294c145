"""titan-run: train from an artifact on every rank.

One run path: the options (each a field of runtime/run_config.py's RunConfig, also settable in
a --config TOML file) are parsed once into a RunConfig, and runtime/run_state.py checks them
against the artifact (and the checkpoint) on every rank, whether titan-run spawned it or
torchrun did. Without RANK set, titan-run first makes the same checks once (runtime/launch.py),
so that a mistake is one line before any rank starts, then spawns the artifact's world size of
local ranks; an artifact of one rank trains in this process (no second interpreter to start).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click

from titan.cli.config_options import config_options, resolve
from titan.cli.errors import Command
from titan.cli.options import NonEmptyPath, command_args, kernel_trust, kernel_trust_options
from titan.runtime.common import interrupt
from titan.runtime.run_config import RunConfig
from titan.runtime.startup import Phases, job_started

if TYPE_CHECKING:
    from titan.runtime.contract.manifest import Manifest


@click.command(cls=Command)
@click.argument("artifact", type=NonEmptyPath(file_okay=False))
@config_options(RunConfig, section="run")
@kernel_trust_options
def main(artifact, trust_keys, trust_unsigned_kernels, **values):
    """Train from ARTIFACT (a directory written by titan-build)."""
    import titan.runtime.common.compiler_caches as compiler_caches
    compiler_caches.ensure()  # regions may compile: the compilers' caches must be private first
    cfg = resolve(RunConfig, values, section="run", kernel_trust=kernel_trust(trust_keys, trust_unsigned_kernels))
    if cfg.resume_with_changes and not cfg.resume:
        raise ValueError("--resume-with-changes only applies with --resume")
    launcher = "RANK" not in os.environ  # else one rank: spawned by the launcher below, or by torchrun
    if launcher and cfg.checkpoint_dir is not None:
        # Registered before the ranks' stop (spawn_local), so it runs after it on a signal.
        interrupt.on_interrupt(lambda: _where_to_resume(cfg.checkpoint_dir))
    if launcher:
        t0 = job_started()
        options = dict(steps=cfg.steps, checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every,
                       resume=cfg.resume, init_from_hf=cfg.init_from_hf)
        art = _announce(artifact, cfg.device, options=options, data=cfg.data, checkpoint_dir=cfg.checkpoint_dir,
                        resume=cfg.resume, init_from_hf=cfg.init_from_hf, metrics=cfg.metrics,
                        tensorboard=cfg.tensorboard)
        if cfg.pp_reduce_per_step and art.manifest.pipeline is None:
            raise ValueError("--pp-reduce-per-step applies to a pipeline artifact (titan-build --pp); drop it")
        with Phases(click.echo)("checking the artifact's files and the run's options (importing torch first)"):
            from titan.runtime.launch import check_run
            origin, notes = check_run(art, cfg)
        for note in notes:
            click.echo(note)
        click.echo(f"start: {origin}")
        click.echo(f"starting {art.world_size} rank(s)")
        if art.world_size > 1:
            from titan.runtime.launch import launch
            sys.exit(launch(art, started=t0, module="titan.cli.run", args=command_args()))
        from titan.runtime.launch import become_the_rank
        become_the_rank(started=t0)  # and train below, in this process
    from titan.runtime.startup import rank_phases
    with rank_phases()(f"rank {os.environ['RANK']}: importing torch", short="torch import"):
        from titan.runtime.distributed import exit_rank
        from titan.runtime.train import rank_main
    exit_rank(rank_main(artifact, cfg))


def _announce(artifact: str, device: str, *, options: dict, **paths):
    """Open the artifact, make the checks that need no torch (the files the options name, the
    memory the ranks need), and say what the run is (and how long its start took last time)."""
    from titan.runtime.common import timings
    from titan.runtime.contract.artifact import open_artifact
    from titan.runtime.launch import run_start_key
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
    pipeline = manifest.pipeline.schedule if manifest.pipeline is not None else None
    return (f"{manifest.model} {manifest.flavor}, {manifest.world_size} rank(s) [{manifest.layout.tag()}], "
            + (f"{pipeline.schedule} pipeline of {pipeline.n_stages} stages, {pipeline.microbatches} micro-batches of "
               if pipeline else "batch ")
            + f"{manifest.batch_size} x seq {manifest.seq_len}, {manifest.dtype}"
            + (f", {manifest.moe_capacity.describe()}" if manifest.moe_capacity is not None else ""))


def check_memory(art, device: str) -> str | None:
    """Refuse a job whose ranks cannot fit this host's memory (on GPU: one GPU's); returns a
    warning when they only exceed what is free now."""
    from titan.runtime.contract.memory_estimate import check_fits, gpu_memory

    gpu = device == "cuda" or (device == "auto" and gpu_memory() is not None)
    # Every rank of a pp coordinate runs alike: one rank's record stands for its block.
    per_block = art.world_size // art.layout.pp
    records = [art.rank_record(pp * per_block) for pp in range(art.layout.pp) for _ in range(per_block)]
    return check_fits(records, gpu=gpu, name=str(art.root))


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


if __name__ == "__main__":
    main()

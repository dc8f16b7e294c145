"""titan-run: train from an artifact on every rank.

One run path: the options (each a field of runtime/run_config.py's RunConfig, also settable in
a --config TOML file) are parsed once into a RunConfig, and runtime/run_state.py checks them
against the artifact (and the checkpoint) on every rank, whether titan-run spawned it or
torchrun did. Without RANK set, titan-run first makes the same checks once, so that a mistake
is one line before any rank starts, then spawns the artifact's world size of local ranks
(runtime/launch.py).
"""

from __future__ import annotations

import os
import sys
import time

import click

from titan.cli.config_options import config_options, resolve
from titan.cli.errors import Command
from titan.cli.options import NonEmptyPath, command_args
from titan.runtime.run_config import RunConfig


@click.command(cls=Command)
@click.argument("artifact", type=NonEmptyPath(file_okay=False))
@config_options(RunConfig, section="run")
def main(artifact, **values):
    """Train from ARTIFACT (a directory written by titan-build)."""
    cfg = resolve(RunConfig, values, section="run")
    if cfg.resume_with_changes and not cfg.resume:
        raise ValueError("--resume-with-changes only applies with --resume")
    launcher = "RANK" not in os.environ  # else one rank: spawned by the launcher below, or by torchrun
    if launcher:
        t0 = time.time()
        art = _announce(artifact, cfg.device)  # the first line, before torch is imported (seconds)
    if not launcher:
        from titan.runtime.distributed import exit_rank
        from titan.runtime.train import rank_main
        exit_rank(rank_main(artifact, cfg))
    from titan.runtime.launch import launch
    sys.exit(launch(art, cfg, started=t0, module="titan.cli.run", args=command_args()))


def _announce(artifact: str, device: str):
    """Open the artifact and say what titan-run does first (and how long it took last time)."""
    from titan.runtime import timings
    from titan.runtime.artifact import open_artifact
    from titan.runtime.launch import run_start_key

    art = open_artifact(artifact)
    last = timings.last("run-start", run_start_key(art.manifest, device))
    click.echo(f"titan-run {art.root}: checking its files and starting {art.world_size} rank(s)"
               + ("" if last is None else f" (step 1 came {last:.1f} s after start last time)"))
    return art


if __name__ == "__main__":
    main()

"""titan-run: train from an artifact on every rank.

Spawns the artifact's world size of local ranks, or, under torchrun (RANK set), runs one rank.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import click

from titan.cli.errors import user_errors


def check_shape_flags(manifest: dict, batch_size, seq_len) -> None:
    for flag, given, built in (("--batch-size", batch_size, manifest["batch_size"]),
                               ("--seq-len", seq_len, manifest["seq_len"])):
        if given is not None and given != built:
            raise ValueError(f"{flag} {given} differs from the artifact's {built} (it shapes the graphs); "
                             f"rebuild with titan-build {flag} {given}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--steps", default=20, show_default=True, type=click.IntRange(min=0),
              help="Train up to this step (counted from the start, also when resuming); 0 with --checkpoint-dir "
                   "only checkpoints the initial weights.")
@click.option("--lr", default=8e-4, show_default=True, type=float, help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for initial weights and synthetic data.")
@click.option("--batch-size", default=None, type=int, help="Must equal the artifact's (it shapes the graphs).")
@click.option("--seq-len", default=None, type=int, help="Must equal the artifact's (it shapes the graphs).")
@click.option("--data", default=None, type=click.Path(dir_okay=False), help="Flat token file (default: synthetic tokens).")
@click.option("--data-dtype", default=None, type=click.Choice(["uint16", "uint32"]),
              help="Token file element type (default: from its titan-data sidecar, else uint16).")
@click.option("--metrics", default=None, type=click.Path(dir_okay=False), help="Write one JSON object per step.")
@click.option("--tensorboard", default=None, type=click.Path(file_okay=False),
              help="Write TensorBoard scalars (loss, tokens/s, step time, GPU peak memory) into this directory.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--deterministic", is_flag=True, help="Deterministic kernels only (GPU).")
@click.option("--timeout", "timeout_s", default=300.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds a rank waits in a collective (or for its peers) before the job fails.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="On GPU, capture forward + backward in a CUDA graph and replay it.")
@click.option("--fused-adamw/--no-fused-adamw", default=True, show_default=True,
              help="On GPU, one AdamW kernel per parameter (bitwise the op-by-op update; needs triton).")
@click.option("--init-from-hf", default=None, type=click.Path(file_okay=False),
              help="Load the initial weights from a Hugging Face Llama directory (config.json + safetensors).")
@click.option("--checkpoint-dir", default=None, type=click.Path(file_okay=False),
              help="Write DCP checkpoints (step-N/ directories) here, at the last step.")
@click.option("--checkpoint-every", default=None, type=click.IntRange(min=1), help="Also checkpoint every K steps.")
@click.option("--resume", is_flag=True, help="Continue from the latest complete checkpoint in --checkpoint-dir.")
@user_errors
def main(artifact, steps, lr, seed, batch_size, seq_len, data, data_dtype, metrics, tensorboard, device, deterministic,
         timeout_s, cuda_graphs, fused_adamw, init_from_hf, checkpoint_dir, checkpoint_every, resume):
    """Train from ARTIFACT (a directory written by titan-build)."""
    from titan.runtime.artifact import open_artifact
    from titan.runtime.train import RunConfig, rank_main

    cfg = RunConfig(steps=steps, lr=lr, seed=seed, data=data, data_dtype=data_dtype, metrics=metrics,
                    tensorboard=tensorboard, device=device, deterministic=deterministic, cuda_graphs=cuda_graphs,
                    fused_adamw=fused_adamw,
                    timeout_s=timeout_s, init_from_hf=init_from_hf, checkpoint_dir=checkpoint_dir,
                    checkpoint_every=checkpoint_every, resume=resume)
    if "RANK" in os.environ:
        from titan.runtime.distributed import exit_rank
        exit_rank(rank_main(artifact, cfg))
    art = open_artifact(artifact)
    check_shape_flags(art.manifest, batch_size, seq_len)
    if data is not None:
        from titan.runtime.data import token_file_dtype
        token_file_dtype(data, dtype=data_dtype, vocab_size=art.manifest["model_config"]["vocab_size"])
    if tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        from titan.runtime.step_log import TENSORBOARD_HINT
        raise ValueError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}")
    art.verify_all()
    from titan.runtime.run_state import RunState
    RunState(cfg, art.manifest, art.rank_meta(0)["params"]).close()  # its checks, once, before ranks start
    if device != "cpu":
        _check_gpus(art.world_size, device)
    from titan.runtime.launch import spawn_local
    sys.exit(spawn_local("titan.cli.run", sys.argv[1:], art.world_size))


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

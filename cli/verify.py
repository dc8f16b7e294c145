"""titan-verify: eager PyTorch vs the artifact, step by step, bit for bit."""

from __future__ import annotations

import os
import sys

import click

from titan.cli.errors import user_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--lr", default=8e-4, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@user_errors
def main(artifact, steps, lr, seed, device):
    """Train ARTIFACT and the same model eagerly (same layout, seed, data); exit 1 on any difference."""
    from titan.runtime.artifact import open_artifact
    from titan.runtime.train import RunConfig

    cfg = RunConfig(steps=steps, lr=lr, seed=seed, device=device)
    if "RANK" in os.environ:
        sys.exit(_rank(artifact, cfg))
    art = open_artifact(artifact)
    art.verify_all()
    from titan.runtime.launch import spawn_local
    sys.exit(spawn_local("titan.cli.verify", sys.argv[1:], art.world_size))


def _rank(artifact: str, cfg) -> int:
    import torch.distributed as dist

    from titan.builder.verify import all_ranks_equal, verify_rank
    from titan.runtime.distributed import RankEnv
    try:
        env = RankEnv.from_environ()
        eager, graph = verify_rank(artifact, cfg, env)
        equal = all_ranks_equal(eager, graph)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        pass
    if env.rank == 0:
        print(f"{'step':>4}  {'eager loss':>22}  {'artifact loss':>22}  same")
        for i, (a, b) in enumerate(zip(eager, graph), 1):
            print(f"{i:>4}  {a.item():>22.17g}  {b.item():>22.17g}  {'yes' if bool((a == b).all()) else 'NO'}")
        print(f"bitwise equal: {'yes' if equal else 'no'}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if equal else 1


if __name__ == "__main__":
    main()

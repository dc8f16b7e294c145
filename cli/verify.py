"""titan-verify: eager PyTorch vs the artifact, step by step, bit for bit."""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import click

from titan.cli.config_options import config_options, resolve
from titan.cli.errors import Command
from titan.cli.options import NonEmptyPath, command_args
from titan.runtime.run_config import RunConfig


VERIFY_FIELDS = ("steps", "lr", "warmup_steps", "decay_type", "decay_ratio", "min_lr_factor", "beta1", "beta2", "eps",
                 "weight_decay", "max_norm", "accumulation_steps", "global_batch_size", "val_data", "val_every",
                 "val_steps", "seed", "data", "data_dtype",
                 "device", "deterministic", "cuda_graphs", "fused_adamw")
"""The run options that decide what is trained (the rest of titan-run's do not apply)."""


@click.command(cls=Command)
@click.argument("artifact", type=NonEmptyPath(file_okay=False))
@config_options(RunConfig, section="run", only=VERIFY_FIELDS, defaults={"steps": 10})
@click.option("--json", "json_path", default=None, type=NonEmptyPath(dir_okay=False),
              help="Also write both loss columns (exact, as float.hex) to this file.")
def main(artifact, json_path, **values):
    """Train ARTIFACT and the same model eagerly (same layout, seed, data, recipe); exit 1 on any difference."""
    cfg = resolve(RunConfig, values, section="run")
    steps, device = cfg.steps, cfg.device
    if steps < 1:
        raise ValueError(f"--steps {steps}: titan-verify compares training steps; pass --steps 1 or more")
    launcher = "RANK" not in os.environ
    if launcher:  # the first line, before torch is imported (seconds)
        from titan.runtime import timings
        from titan.runtime.artifact import open_artifact
        art = open_artifact(artifact)
        key = f"{art.manifest.cache_key}-{steps}-{device}"
        click.echo(f"titan-verify {art.root}: training {steps} step(s) eagerly and from the artifact on "
                   f"{art.world_size} rank(s), then comparing every loss and parameter{timings.expectation('verify', key)}")
        t0 = time.perf_counter()
    if not launcher:
        from titan.runtime.distributed import exit_rank
        exit_rank(_rank(artifact, cfg, json_path))
    art.verify_all()
    from titan.runtime.run_state import RunState
    RunState(cfg, art.manifest, art.rank_record(0).params).close()  # the run's checks (--data), once
    from titan.runtime.launch import spawn_local
    code = spawn_local("titan.cli.verify", command_args(), art.world_size)
    if code in (0, 1):  # finished (equal or not)
        timings.record("verify", key, time.perf_counter() - t0)
    sys.exit(code)


def _rank(artifact: str, cfg, json_path: str | None) -> int:
    from titan.runtime.train import rank_main
    return rank_main(artifact, cfg, functools.partial(_verify, json_path=json_path))


def _verify(artifact: str, cfg, env, *, json_path: str | None) -> int:
    import torch

    from titan.cli.tools.verify import all_ranks_equal, verify_rank
    verdict = verify_rank(artifact, cfg, env)
    steps_equal, differ = all_ranks_equal(verdict)
    equal = steps_equal and differ == 0
    eager, graph = verdict.eager, verdict.artifact
    if env.rank == 0:
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"eager": [x.item().hex() for x in eager.losses],
                           "artifact": [x.item().hex() for x in graph.losses],
                           "eager_grad_norm": [x.item().hex() for x in eager.grad_norms],
                           "artifact_grad_norm": [x.item().hex() for x in graph.grad_norms],
                           "eager_val_loss": [[s, x.item().hex()] for s, x in eager.val_losses],
                           "artifact_val_loss": [[s, x.item().hex()] for s, x in graph.val_losses],
                           "parameters_differing": differ, "bitwise_equal": equal}, f)
        print(f"{'step':>4}  {'eager loss':>22}  {'artifact loss':>22}  {'eager grad norm':>22}  "
              f"{'artifact grad norm':>22}  same")
        for i, (a, b, na, nb) in enumerate(zip(eager.losses, graph.losses, eager.grad_norms, graph.grad_norms), 1):
            same = torch.equal(a, b) and torch.equal(na, nb)
            print(f"{i:>4}  {a.item():>22.17g}  {b.item():>22.17g}  {na.item():>22.17g}  {nb.item():>22.17g}  "
                  f"{'yes' if same else 'NO'}")
        for (s, a), (_, b) in zip(eager.val_losses, graph.val_losses):
            print(f"validation after step {s}: eager {a.item():.17g}, artifact {b.item():.17g}, "
                  f"{'same' if torch.equal(a, b) else 'DIFFERENT'}")
        print(f"parameters after step {len(graph.losses)}: " + ("all bitwise equal" if differ == 0 else
              f"{differ} tensors differ") + f" ({verdict.params} tensors per rank, {env.world_size} ranks)")
        print(f"bitwise equal: {'yes' if equal else 'no'}", flush=True)
        changing = _numerics_changing_passes(artifact)
        if changing and not equal:
            worst = max(abs(a.item() - b.item()) / max(abs(a.item()), 1e-30)
                        for a, b in zip(eager.losses, graph.losses))
            print(f"note: built with passes that change numerics ({', '.join(changing)}); largest relative loss "
                  f"difference {worst:.2e}", flush=True)
    return 0 if equal else 1


def _numerics_changing_passes(artifact: str) -> list[str]:
    from titan.builder.passes import PASSES
    from titan.runtime.artifact import open_artifact
    passes = open_artifact(artifact).manifest.passes
    return [p for p in passes if p in PASSES and not PASSES[p].preserves_numerics]


if __name__ == "__main__":
    main()

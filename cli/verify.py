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
from titan.cli.options import NonEmptyPath, command_args, kernel_trust, kernel_trust_options
from titan.runtime.run_config import RunConfig


VERIFY_FIELDS = ("steps", "lr", "warmup_steps", "decay_type", "decay_ratio", "min_lr_factor", "beta1", "beta2", "eps",
                 "weight_decay", "max_norm", "accumulation_steps", "global_batch_size", "val_data", "val_every",
                 "val_steps", "seed", "data", "data_dtype",
                 "device", "deterministic", "cuda_graphs", "fused_adamw", "pp_gather_per_step")
"""The run options that decide what is trained (the rest of titan-run's do not apply)."""


@click.command(cls=Command)
@click.argument("artifact", type=NonEmptyPath(file_okay=False))
@config_options(RunConfig, section="run", only=VERIFY_FIELDS, defaults={"steps": 10})
@click.option("--json", "json_path", default=None, type=NonEmptyPath(dir_okay=False),
              help="Also write both loss columns (exact, as float.hex) to this file.")
@click.option("--moe-drop", "moe_drop", is_flag=True,
              help="Accept an artifact built with --moe-drop (it drops MoE assignments past its capacity: numerics "
                   "change) and compare it with eager PyTorch dropping at the same capacity.")
@kernel_trust_options
def main(artifact, json_path, moe_drop, trust_keys, trust_unsigned_kernels, **values):
    """Train ARTIFACT and the same model eagerly (same layout, seed, data, recipe); exit 1 on any difference."""
    import titan.runtime.common.compiler_caches as compiler_caches
    compiler_caches.ensure()  # regions may compile: the compilers' caches must be private first
    cfg = resolve(RunConfig, values, section="run", kernel_trust=kernel_trust(trust_keys, trust_unsigned_kernels))
    steps, device = cfg.steps, cfg.device
    if steps < 1:
        raise ValueError(f"--steps {steps}: titan-verify compares training steps; pass --steps 1 or more")
    launcher = "RANK" not in os.environ
    if launcher:  # the first line, before torch is imported (seconds)
        from titan.cli.run import check_memory, describe_build
        from titan.runtime.common import timings
        from titan.runtime.contract.artifact import open_artifact
        from titan.runtime.run_paths import check_run_paths
        from titan.runtime.startup import Phases, job_started
        t0 = job_started()
        art = open_artifact(artifact)
        from titan.cli.tools.verify_reference import check_drop_label
        check_drop_label(art.manifest, moe_drop)
        check_run_paths(data=cfg.data, metrics=json_path)
        warning = check_memory(art, device)
        key = f"{art.manifest.cache_key}-{steps}-{device}"
        reference = (f"; the eager reference drops past MoE capacity {art.manifest.moe_capacity.factor:g} too "
                     "(--moe-drop: not the dropless model)") if moe_drop else ""
        click.echo(f"titan-verify {art.root}: {describe_build(art.manifest)}; training {steps} step(s) eagerly and "
                   f"from the artifact, then comparing every loss and parameter{reference}"
                   f"{timings.expectation('verify', key)}")
        if warning:
            click.echo(f"warning: {warning}")
        checking = Phases(click.echo)("checking the artifact's files and the eager model (importing torch first)")
    else:
        from titan.runtime.startup import rank_phases
        checking = rank_phases()(f"rank {os.environ['RANK']}: importing torch", short="torch import")
    with checking:
        if launcher:
            art.verify_all()
            from titan.cli.tools.verify import eager_config
            eager_config(art.manifest)  # the eager model can be built (a mistake is one line, not one per rank)
            from titan.runtime.run_state import RunState
            state = RunState(cfg, art.manifest, art.model_params())  # the run's checks (--data), once
            state.close()
    if not launcher:
        from titan.runtime.distributed import exit_rank
        exit_rank(_rank(artifact, cfg, json_path))
    for note in state.notes:
        click.echo(note)
    click.echo(f"start: {state.origin()}")
    click.echo(f"starting {art.world_size} rank(s)")
    from titan.runtime.launch import spawn_local
    from titan.runtime.startup import SPAWNED_ENV, STARTED_ENV
    os.environ[STARTED_ENV], os.environ[SPAWNED_ENV] = repr(t0), repr(time.time())
    code = spawn_local("titan.cli.verify", command_args(), art.world_size)
    if code in (0, 1):  # finished (equal or not)
        timings.record("verify", key, time.time() - t0)
    sys.exit(code)


def _rank(artifact: str, cfg, json_path: str | None) -> int:
    from titan.runtime.train import rank_main
    return rank_main(artifact, cfg, functools.partial(_verify, json_path=json_path))


def _verify(artifact: str, cfg, env, *, json_path: str | None) -> int:
    import torch

    from titan.cli.tools.verify import all_ranks_equal, verify_rank
    verdict = verify_rank(artifact, cfg, env)
    steps_equal, differ, buffers_differ, buffers = all_ranks_equal(verdict)
    equal = steps_equal and differ == 0 and buffers_differ == 0
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
                           "parameters_differing": differ, "buffers_differing": buffers_differ,
                           "bitwise_equal": equal,
                           # A bounded MoE dispatch: each step's micro-batches redone dropless.
                           **({"artifact_moe_redone": [r["moe_redone"] for r in verdict.artifact_steps]}
                              if verdict.artifact_steps and "moe_redone" in verdict.artifact_steps[0] else {})}, f)
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
        if buffers:
            print(f"model buffers after step {len(graph.losses)}: " + ("all bitwise equal" if buffers_differ == 0
                  else f"{buffers_differ} tensors differ") + f" ({buffers} tensors on {env.world_size} ranks)")
        print(f"bitwise equal: {'yes' if equal else 'no'}", flush=True)
        changing = _numerics_changing_passes(artifact)
        if changing and not equal:
            worst = max(abs(a.item() - b.item()) / max(abs(a.item()), 1e-30)
                        for a, b in zip(eager.losses, graph.losses))
            print(f"note: built with passes that change numerics ({', '.join(changing)}); largest relative loss "
                  f"difference {worst:.2e}", flush=True)
        print(_summary(verdict), flush=True)
    return 0 if equal else 1


def _summary(v) -> str:
    """The paragraph that ends titan-verify: time, where it went, speeds, losses, memory."""
    import statistics

    import torch

    from titan.runtime import startup

    phases = startup.rank_phases()
    startup.launcher_phase(phases)
    speed = {name: statistics.median(r["tokens_per_s"] for r in steps)
             for name, steps in (("artifact", v.artifact_steps), ("eager", v.eager_steps)) if steps}
    gpu = v.device.type == "cuda"
    memory = startup.peak_memory_text(v.device.type, torch.cuda.max_memory_allocated(v.device) if gpu else None)
    parts = [f"done: {len(v.artifact.losses)} step(s) eagerly and from the artifact in "
             f"{time.time() - startup.job_started():.1f} s ({phases.breakdown()})",
             " and ".join(f"{name} median {s:,.0f} tokens/s" for name, s in speed.items())]
    if v.artifact_steps:
        first, last = v.artifact_steps[0], v.artifact_steps[-1]
        parts.append(f"loss {first['loss']:.4f} at step {first['step']}, {last['loss']:.4f} at step {last['step']}")
    if memory:
        parts.append(memory)
    from titan.runtime.moe_redo import redo_summary
    redo = redo_summary(v.artifact_steps)
    return "; ".join(p for p in parts if p) + "." + (f"\n{redo}." if redo else "")


def _numerics_changing_passes(artifact: str) -> list[str]:
    from titan.builder.passes.registry import PASSES
    from titan.runtime.contract.artifact import open_artifact
    passes = open_artifact(artifact).manifest.passes
    return [p for p in passes if p in PASSES and not PASSES[p].preserves_numerics]


if __name__ == "__main__":
    main()

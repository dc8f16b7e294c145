"""titan-build: trace, partition and serialize every rank of a layout into an artifact.

Each option is a field of builder/spec/build_config.py's BuildConfig (also a key of a --config
TOML file, section [build]); --shape FIELD=VALUE, repeatable, is the one option of its own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from titan.builder.spec.build_config import BuildConfig
from titan.cli.config_options import config_options, resolve
from titan.cli.errors import Command

SHAPE_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim")
"""The model dimensions titan-build sets by name on top of a flavor (--shape sets any other)."""


@click.command(cls=Command)
@config_options(BuildConfig, section="build")
@click.option("--shape", "shape_args", multiple=True, metavar="FIELD=VALUE",
              help="Set any field of the family's config on top of the flavor (repeatable), e.g. "
                   "--shape moe_hidden=64 for deepseek_v3; an unknown FIELD lists them.")
def main(shape_args, **values):
    """Build a training artifact; needs no GPU. Reuses the shared build cache."""
    cfg = resolve(BuildConfig, values, section="build")
    model, flavor, passes, jobs, explain, sign_key = cfg.model, cfg.flavor, cfg.passes, cfg.jobs, cfg.explain, cfg.sign
    out = None if cfg.out is None else Path(cfg.out)
    cache_dir = None if cfg.cache_dir is None else Path(cfg.cache_dir)
    list_passes, replace, kernels = cfg.list_passes, cfg.replace, cfg.kernels
    import titan.runtime.common.compiler_caches as compiler_caches
    from titan.runtime.kernels.artifact_trust import sign_artifact, signing_key
    compiler_caches.ensure()  # tracing and --kernels drive inductor: its caches must be private first
    if list_passes:
        from titan.builder.passes.registry import PASSES, default_passes
        defaults = default_passes({"dp_shard": 2})
        for name, p in PASSES.items():
            label = "numerics-preserving" if p.preserves_numerics else "CHANGES NUMERICS (opt-in)"
            default = ", default" if name in defaults else ""
            needs = f", needs {' and '.join('--' + d.replace('_', '-') + ' > 1' for d in p.needs)}" if p.needs else ""
            click.echo(f"{name} [{label}{default}{needs}]: {p.line}")
        return
    from titan.builder.build import build, nearest_entry
    from titan.builder.export.manifest import check_replaceable
    from titan.builder.spec.build_spec import make_spec
    from titan.runtime.store.build_cache import Cache
    from titan.builder.spec.cache_key import build_factors, digest
    import titan.runtime.common.timings as timings
    from titan.runtime.contract.memory_estimate import PARAM_STATE_BYTES, param_elements
    from titan.runtime.store.lock import LOCK_WAIT_ENV, lock_wait_s
    signer_key = signing_key(sign_key)  # a key file that cannot be used is refused before anything is traced
    target = None
    if cfg.gpu is not None:  # refused before anything is traced, as a key file is
        from titan.builder.export.gpu_target import gpu_target, toolchain_problem
        if not kernels:
            raise ValueError(f"--gpu {cfg.gpu} names the GPU to build kernels for: add --kernels")
        target = gpu_target(cfg.gpu)
        problem = toolchain_problem(target)
        if problem:
            raise ValueError(problem)
    from titan.builder.models.shape import parse_shape_args
    from titan.cli.build_progress import BuildProgress

    shape = parse_shape_args(shape_args)
    shape.update({k: v for k in SHAPE_FIELDS if (v := getattr(cfg, k)) is not None})
    spec = make_spec(model=model, flavor=flavor, tp=cfg.tp, dp_shard=cfg.dp_shard, dp_replicate=cfg.dp_replicate,
                     ep=cfg.ep, batch_size=cfg.batch_size, seq_len=cfg.seq_len, partitioner=cfg.partitioner,
                     dtype=cfg.dtype, ac=cfg.ac, fuse=cfg.fuse, attention=cfg.attention, mask=cfg.mask,
                     eos_id=cfg.eos_id,
                     passes=None if passes is None else tuple(p for p in passes.split(",") if p), shape=shape,
                     moe_capacity=cfg.moe_capacity, moe_drop=cfg.moe_drop, etp=cfg.etp, pp=cfg.pp,
                     microbatches=cfg.microbatches, pp_schedule=cfg.pp_schedule, pp_split=cfg.pp_split,
                     pp_stages_per_rank=cfg.pp_stages_per_rank)
    if cfg.pp_plan:
        from titan.cli.pipeline_plan import show_pipeline_plan
        show_pipeline_plan(spec)
        return
    out = out or Path("artifacts") / spec.name
    lock_wait_s()  # a bad TITAN_LOCK_WAIT is refused before any work
    if not replace:
        check_replaceable(spec, out)
    jobs = jobs or os.cpu_count() or 1
    world = spec.layout.world_size
    key = digest(build_factors(spec))
    if flavor is None:
        from titan.builder.spec.host_fit import default_flavor_warning
        warning = default_flavor_warning(spec)
        if warning:
            click.echo(f"warning: {warning}")
    custom = "".join(f", {name} {value:g}" if isinstance(value, float) else f", {name} {value}"
                     for name, value in spec.shape)
    click.echo(f"building {out}: {model} {spec.flavor}{custom}, {world} rank(s) [{spec.layout.tag()}], batch "
               f"{spec.batch_size} x seq {spec.seq_len}, {spec.dtype}{timings.expectation('build', key)}")
    t0 = time.perf_counter()
    from titan.builder.program.bind import probe_ranks
    # The ranks traced (one program binds the rest): a pipeline's probes are its stages' own.
    probes = (len(probe_ranks(spec.layout)) if spec.pipeline is None
              else sum(len(probe_ranks(stage.layout)) for stage in spec.stage_builds()))
    shown = BuildProgress(probes)

    def progress(res):
        t = res.timings
        meta = res.meta
        state = param_elements(meta) * PARAM_STATE_BYTES  # fp32 param, grad, 2 AdamW moments
        depth = "" if res.depth is None else f" ({res.depth} layers)"
        shown.rank_done(f"  rank {res.rank}{depth}: done: traced in {t['export_s']:.1f} s, partitioned in "
                        f"{t['partition_s']:.1f} s, passes {t['passes_s']:.1f} s; memory: {meta.saved_activations} "
                        f"saved activations {meta.saved_bytes / 2**30:.2f} GiB + params/grads/AdamW "
                        f"{state / 2**30:.2f} GiB")

    cache = Cache(cache_dir)

    def on_miss(why: str) -> None:
        nearest = nearest_entry(cache, build_factors(spec))
        if nearest is None:
            click.echo(f"cache: miss ({why}; no cached build of {model} yet)")
        else:
            diff = nearest[1] or ["nothing (the entry is damaged)"]
            shown = diff if explain else diff[:3]
            more = "" if explain or len(diff) <= 3 else f", +{len(diff) - 3} more (--explain)"
            click.echo(f"cache: miss ({why}; nearest entry {nearest[0][:12]} differs in: {', '.join(shown)}{more})")
        click.echo(f"tracing in {min(jobs, world)} worker process(es), forked from one that imports torch first "
                   "(a few seconds)")

    try:
        outcome = build(spec, out, cache=cache, jobs=jobs, progress=progress, on_miss=on_miss, on_stage=shown.stage,
                        on_wait=lambda holder: click.echo(f"waiting for {holder}, which holds this build's lock "
                                                          f"(at most {lock_wait_s():.0f} s, {LOCK_WAIT_ENV})"),
                        on_give_up=lambda holder, waited: click.echo(
                            f"note: {holder} still holds this build's lock after {waited:.0f} s; building without it"))
    finally:
        shown.finish()
    if outcome.hit:
        click.echo(f"cache: hit ({outcome.key[:12]})")
    else:
        timings.record("build", outcome.key, time.perf_counter() - t0)
    manifest = outcome.manifest
    if kernels and spec.pipeline is not None:
        from titan.builder.export.kernels import add_pipeline_kernels
        manifest, per_stage = add_pipeline_kernels(cache, spec, out, target=target)
        click.echo(f"kernels: {len(manifest.kernels)} in the artifact (all stages)")
        for s, stats in enumerate(per_stage):
            click.echo(f"  stage {s}: {stats.line()}")
    elif kernels:
        from titan.builder.export.kernels import add_kernels
        manifest, stats = add_kernels(cache, outcome.key, out, redo=outcome.redo, target=target)
        click.echo(f"kernels: {len(manifest.kernels)} in the artifact; {stats.line()}")
    signer = sign_artifact(out, signer_key)  # your own key unless --sign names one
    if sign_key is not None:
        click.echo(f"signed: {out}/manifest.sig with key {signer} ({sign_key}; titan-run --trust {sign_key} loads "
                   "its kernels)")
    size = sum((out / rel).stat().st_size for rel in manifest.files)
    programs = len(manifest.programs)
    if outcome.note:
        click.echo(f"note: {outcome.note}")
    if spec.moe_redo:
        from titan.runtime.contract.artifact import open_artifact
        from titan.runtime.contract.memory_estimate import capacity_saving
        art = open_artifact(out, check_torch=False)
        click.echo("memory: " + capacity_saving(art.rank_record(0), art.rank_record(0, redo=True)))
        if (art.rank_record(0).model_plan or {}).get("dropless"):
            click.echo(f"note: capacity {spec.moe_capacity:g} reaches the dropless bound of this layout: no step can "
                       "overflow, and the dropless build alone would do")
    if spec.pipeline is not None:
        from titan.cli.pipeline_memory import pipeline_memory_lines
        from titan.runtime.contract.artifact import open_artifact
        for line in pipeline_memory_lines(open_artifact(out, check_torch=False)):
            click.echo(line)
    shallow = f" in {outcome.traces} shallow traces" if outcome.traces > len(outcome.traced) else ""
    if spec.pipeline is not None:  # a trace is one stage's, on a rank of its own block
        shallow = f" in {outcome.traces} stage traces"
    traced = f"traced {len(outcome.traced)} rank(s){shallow} into " if outcome.traced else ""
    click.echo(f"wrote {out} ({size / 2**20:.1f} MiB, {traced}{programs} program{'s' * (programs > 1)} "
               f"for {world:,} ranks) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

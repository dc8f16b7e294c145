"""titan-build: trace, partition and serialize every rank of a layout into an artifact."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import click

from titan.builder.build_config import BuildConfig
from titan.cli.config_options import config_options, resolve
from titan.cli.errors import Command


@click.command(cls=Command)
@config_options(BuildConfig, section="build")
def main(**values):
    """Build a training artifact; needs no GPU. Reuses the shared build cache."""
    cfg = resolve(BuildConfig, values, section="build")
    model, flavor, passes, jobs, explain = cfg.model, cfg.flavor, cfg.passes, cfg.jobs, cfg.explain
    out = None if cfg.out is None else Path(cfg.out)
    cache_dir = None if cfg.cache_dir is None else Path(cfg.cache_dir)
    list_passes, replace, kernels = cfg.list_passes, cfg.replace, cfg.kernels
    if list_passes:
        from titan.builder.passes import PASSES, default_passes
        defaults = default_passes({"dp_shard": 2})
        for name, p in PASSES.items():
            label = "numerics-preserving" if p.preserves_numerics else "CHANGES NUMERICS (opt-in)"
            default = ", default" if name in defaults else ""
            needs = f", needs {' and '.join('--' + d.replace('_', '-') + ' > 1' for d in p.needs)}" if p.needs else ""
            click.echo(f"{name} [{label}{default}{needs}]: {p.line}")
        return
    from titan.builder.build import build, check_replaceable, make_spec, nearest_entry
    from titan.builder.cache import Cache
    from titan.builder.cache_key import build_factors, digest
    from titan.runtime import timings
    from titan.cli.build_progress import BuildProgress

    spec = make_spec(model=model, flavor=flavor, tp=cfg.tp, dp_shard=cfg.dp_shard, dp_replicate=cfg.dp_replicate,
                     ep=cfg.ep, batch_size=cfg.batch_size, seq_len=cfg.seq_len, partitioner=cfg.partitioner,
                     dtype=cfg.dtype, ac=cfg.ac, fuse=cfg.fuse,
                     passes=None if passes is None else tuple(p for p in passes.split(",") if p))
    out = out or Path("artifacts") / spec.name
    if not replace:
        check_replaceable(spec, out)
    jobs = jobs or os.cpu_count() or 1
    world = spec.layout.world_size
    key = digest(build_factors(spec))
    click.echo(f"building {out}: {model} {spec.flavor}, {world} rank(s) [{spec.layout.tag()}], batch "
               f"{spec.batch_size} x seq {spec.seq_len}, {spec.dtype}{timings.expectation('build', key)}")
    t0 = time.perf_counter()
    from titan.builder.program import probe_ranks
    shown = BuildProgress(len(probe_ranks(spec.layout)))  # the ranks traced (one program binds the rest)

    def progress(res):
        t = res.timings
        meta = res.meta
        state = sum(math.prod(p.local_shape) for p in meta.params) * 16  # fp32 param, grad, 2 AdamW moments
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
                        on_wait=lambda: click.echo("waiting for another titan-build of the same key"))
    finally:
        shown.finish()
    if outcome.hit:
        click.echo(f"cache: hit ({outcome.key[:12]})")
    else:
        timings.record("build", outcome.key, time.perf_counter() - t0)
    manifest = outcome.manifest
    if kernels:
        from titan.builder.kernels import add_kernels
        manifest, stats = add_kernels(cache, outcome.key, out)
        click.echo(f"kernels: {len(manifest.kernels)} in the artifact; {stats.line()}")
    size = sum((out / rel).stat().st_size for rel in manifest.files)
    programs = len(manifest.programs)
    if outcome.note:
        click.echo(f"note: {outcome.note}")
    shallow = f" in {outcome.traces} shallow traces" if outcome.traces > len(outcome.traced) else ""
    traced = f"traced {len(outcome.traced)} rank(s){shallow} into " if outcome.traced else ""
    click.echo(f"wrote {out} ({size / 2**20:.1f} MiB, {traced}{programs} program{'s' * (programs > 1)} "
               f"for {world:,} ranks) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

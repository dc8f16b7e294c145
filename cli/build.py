"""titan-build: trace, partition and serialize every rank of a layout into an artifact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from titan.cli.errors import Command
from titan.cli.options import POSITIVE, NonEmptyPath


def _flavor_help() -> str:
    from titan.builder.models.deepseek_v3.config import FLAVORS as DEEPSEEK_V3
    from titan.builder.models.llama3.config import FLAVORS as LLAMA3

    def names(flavors) -> str:
        return ", ".join(f"{n} (default)" if n == flavors.default else n for n in flavors)
    return f"Model size: llama3: {names(LLAMA3)}; deepseek_v3: {names(DEEPSEEK_V3)}."


FLAVOR_HELP = _flavor_help()


@click.command(cls=Command)
@click.option("--model", default="llama3", show_default=True, help="Model family: llama3, deepseek_v3 or qwen3.")
@click.option("--flavor", default=None, help=FLAVOR_HELP)
@click.option("--tp", default=1, show_default=True, type=POSITIVE, help="Tensor-parallel degree (with sequence parallel).")
@click.option("--dp-shard", default=1, show_default=True, type=POSITIVE, help="FSDP degree.")
@click.option("--dp-replicate", default=1, show_default=True, type=POSITIVE, help="Replicated data-parallel degree.")
@click.option("--ep", default=1, show_default=True, type=POSITIVE,
              help="Expert-parallel degree (mixture-of-experts models): routed experts split over this many ranks, "
                   "which are data parallel for everything else.")
@click.option("--batch-size", default=None, type=POSITIVE, help="Sequences per data-parallel rank (default: 2 debug flavors, 1 otherwise).")
@click.option("--seq-len", default=None, type=click.IntRange(min=2), help="Tokens per sequence (default: 128 debug flavors, 8192 otherwise).")
@click.option("--dtype", default=None, type=click.Choice(["bf16", "fp32"]), help="Compute dtype: bf16 (default; fp32 for the debug flavors) or fp32. "
              "Parameters and optimizer state stay fp32.")
@click.option("--passes", "passes", default=None,
              help="Graph passes after partitioning, comma-separated, in order ('' for none; default: "
                   "the numerics-preserving set). --list-passes shows them.")
@click.option("--ac", default="none", show_default=True, type=click.Choice(["none", "full", "selective"]),
              help="Activation checkpointing: recompute block activations in the backward (full), or all but "
                   "matmul/attention outputs (selective).")
@click.option("--fuse", type=click.Choice(["regions", "blocks"]), default=None, is_flag=False, flag_value="blocks",
              help="Fused kernels that titan-run generates on its GPU (faster; numerics differ from eager in the last "
                   "bits): 'blocks' (a bare --fuse): all element-wise and reduction work between matmuls, attention "
                   "and collectives; 'regions': only within RMSNorm, RoPE, SwiGLU and the loss.")
@click.option("--list-passes", is_flag=True, help="Describe the available passes and exit.")
@click.option("--partitioner", default="min_cut", show_default=True, type=click.Choice(["min_cut", "default"]),
              help="Forward/backward partitioner.")
@click.option("--out", default=None, type=NonEmptyPath(path_type=Path),
              help="Output directory (default: artifacts/<name>, the name spelling out every non-default choice).")
@click.option("--replace", is_flag=True, help="Replace the artifact at --out even if it is of another build.")
@click.option("--jobs", default=None, type=POSITIVE, help="Ranks traced in parallel (default: CPU count).")
@click.option("--cache-dir", default=None, type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Build cache (default: $TITAN_CACHE_DIR or ~/.cache/titan).")
@click.option("--explain", is_flag=True, help="On a cache miss, list every factor that differs from the nearest entry.")
@click.option("--kernels", is_flag=True, help="Also compile the fusion kernels on this host's GPU (one GPU of the kind "
              "the job will use) into the cache entry and the artifact, so that no rank compiles at start-up.")
@click.option("--sign", "sign_key", default=None, type=NonEmptyPath(dir_okay=False),
              help="Sign the artifact's manifest with this key file (made, mode 0600, if missing) instead of your own "
                   "cache key: titan-run --trust KEYFILE then loads the compiled kernels it carries.")
@click.option("--n-layers", default=None, type=POSITIVE, help="Transformer blocks (default: the flavor's).")
@click.option("--dim", default=None, type=POSITIVE, help="Model width (default: the flavor's).")
@click.option("--n-heads", default=None, type=POSITIVE, help="Attention (query) heads (default: the flavor's).")
@click.option("--n-kv-heads", default=None, type=POSITIVE, help="Key/value heads, llama3 (default: the flavor's).")
@click.option("--vocab-size", default=None, type=POSITIVE,
              help="Vocabulary: embedding rows and logits, e.g. your tokenizer's (default: the flavor's).")
@click.option("--ffn-dim", default=None, type=POSITIVE, help="Feed-forward hidden width, llama3 (default: derived "
              "from the width as Llama 3 does).")
@click.option("--shape", "shape_args", multiple=True, metavar="FIELD=VALUE",
              help="Set any field of the family's config on top of the flavor (repeatable), e.g. "
                   "--shape moe_hidden=64 for deepseek_v3; an unknown FIELD lists them.")
def main(model, flavor, tp, dp_shard, dp_replicate, ep, batch_size, seq_len, dtype, passes, ac, fuse, list_passes, partitioner, out,
         replace, jobs, cache_dir, explain, kernels, sign_key, n_layers, dim, n_heads, n_kv_heads, vocab_size, ffn_dim, shape_args):
    """Build a training artifact; needs no GPU. Reuses the shared build cache."""
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
    from titan.runtime.memory_estimate import PARAM_STATE_BYTES, param_elements
    from titan.runtime.store.lock import LOCK_WAIT_ENV, lock_wait_s
    signer_key = signing_key(sign_key)  # a key file that cannot be used is refused before anything is traced
    from titan.builder.models.shape import parse_shape_args
    from titan.cli.build_progress import BuildProgress

    shape = parse_shape_args(shape_args)
    shape.update({k: v for k, v in dict(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                        vocab_size=vocab_size, ffn_dim=ffn_dim).items() if v is not None})
    spec = make_spec(model=model, flavor=flavor, tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep,
                     batch_size=batch_size, seq_len=seq_len, partitioner=partitioner, dtype=dtype, ac=ac, fuse=fuse,
                     passes=None if passes is None else tuple(p for p in passes.split(",") if p), shape=shape)
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
    shown = BuildProgress(len(probe_ranks(spec.layout)))  # the ranks traced (one program binds the rest)

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
    if kernels:
        from titan.builder.export.kernels import add_kernels
        manifest, stats = add_kernels(cache, outcome.key, out)
        click.echo(f"kernels: {len(manifest.kernels)} in the artifact; {stats.line()}")
    signer = sign_artifact(out, signer_key)  # your own key unless --sign names one
    if sign_key is not None:
        click.echo(f"signed: {out}/manifest.sig with key {signer} ({sign_key}; titan-run --trust {sign_key} loads "
                   "its kernels)")
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

"""titan-cache: list, inspect, verify and garbage-collect the shared build cache and the kernel
store beside it (compiled fusion regions, runtime/store/kernel_store.py)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import click

from titan.cli.errors import Group
from titan.cli.options import NonEmptyPath

_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-size {text!r}: use a number with an optional unit, e.g. 500M or 20G")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def parse_age(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise ValueError(f"--older-than {text!r}: use a number and a unit s, m, h, d or w, e.g. 7d")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _ago(ts: float) -> str:
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


@click.group(cls=Group)
@click.option("--cache-dir", default=None, type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Build cache (default: $TITAN_CACHE_DIR or ~/.cache/titan).")
@click.pass_context
def main(ctx, cache_dir):
    """Manage the content-addressed build cache."""
    ctx.obj = cache_dir


def _cache(ctx):
    from titan.runtime.store.build_cache import Cache
    return Cache(ctx.obj)


def _kernels(cache):
    from titan.runtime.store.kernel_store import KernelStore
    return KernelStore(cache.root / "kernels")


def _kernel_line(cache) -> str:
    entries = _kernels(cache).entries()
    if not entries:
        return ""
    last = max(e.last_used for e in entries)
    return (f"kernels: {len(entries)} compiled regions, {_human(sum(e.size for e in entries))}, "
            f"last used {_ago(last)}")


@main.command("ls")
@click.pass_context
def ls_cmd(ctx):
    """Entries: key, model and layout, batch shape, other non-default choices (dtype, AC,
    passes), torch release, ranks, distinct blobs, size, last use."""
    cache = _cache(ctx)
    infos = sorted(cache.entries(), key=lambda i: -i.last_used)
    kernels = _kernel_line(cache)
    if not infos:
        click.echo(f"{cache.root}: " + (f"no builds; {kernels}" if kernels else "empty"))
        return
    from titan.builder.spec.build_spec import non_default_choices
    from titan.builder.models import MODELS

    def exact_fusion(model: str) -> bool:
        return MODELS[model].exact_fusion if model in MODELS else True
    rows = []
    for i in infos:
        f = i.entry["factors"]
        mesh = "-".join(f"{n.replace('_', '-')}{s}" for n, s in f["mesh"]) or "single"
        # Whatever else shapes the graphs (a custom shape, dtype, AC, passes) and differs from the defaults.
        choices = _custom_shape(f) + non_default_choices(
            flavor=f["flavor"], mesh=f["mesh"], batch_size=f["batch size"], seq_len=f["seq len"], dtype=f["dtype"],
            ac=f["activation checkpointing"], passes=f["passes"], exact_fusion=exact_fusion(f["model"]))
        choices = [c for c in choices if c[0] not in "bs" or not c[1:].isdigit()]  # the batch column has those
        rows.append((i.key[:12], f"{f['model']} {f['flavor']}", mesh, f"{f['batch size']}x{f['seq len']}",
                     " ".join(choices) or "defaults", f["torch version"], str(len(i.entry["ranks"])),
                     str(len(cache.entry_blobs(i.entry))), _human(i.size), _ago(i.last_used)))
    header = ("key", "model", "layout", "batch", "choices", "torch", "ranks", "blobs", "size", "last used")
    # Each column as wide as its longest cell (a DeepSeek-V3 flavor name is longer than a Llama one).
    widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header))]
    right = {3, 6, 7, 8}
    for row in (header, *rows):
        click.echo("  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                             for c, (cell, w) in enumerate(zip(row, widths))).rstrip())
    click.echo(f"total {_human(cache.size())} in {cache.root}")
    if kernels:
        click.echo(kernels)


def _custom_shape(factors: dict) -> list[str]:
    """Tags for the model dimensions an entry set on top of its flavor (titan-build --dim ...) and
    its attention choice (--attention flex ...)."""
    from titan.builder.models import MODELS
    from titan.builder.models.attention import attention_tags
    from titan.builder.models.shape import shape_tags

    family = MODELS.get(factors["model"])
    if family is None or factors["flavor"] not in family.flavors:
        return []
    base = family.flavors[factors["flavor"]].as_dict()
    config = factors.get("model config") or {}
    return shape_tags({k: v for k, v in config.items() if k in base and base[k] != v}) + attention_tags(config)


@main.command("info")
@click.argument("key")
@click.pass_context
def info_cmd(ctx, key):
    """Factors and programs of one entry (KEY may be a unique prefix)."""
    cache = _cache(ctx)
    info = cache.info(cache.resolve(key))
    click.echo(f"key {info.key}\nsize {_human(info.size)}, last used {_ago(info.last_used)}\nfactors:")
    for name, value in info.entry["factors"].items():
        click.echo(f"  {name}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    assignment = info.entry["rank_programs"]
    click.echo(f"programs (traced ranks {' '.join(map(str, info.entry.get('traced_ranks', [])))}):")
    for i, p in enumerate(info.entry["programs"]):
        click.echo(f"  {i}: forward {p['forward'][:12]} backward {p['backward'][:12]} meta {p['meta'][:12]}, "
                   f"{p.get('bindings', 0)} bindings, {assignment.count(i)} of {len(assignment)} ranks")


@main.command("verify")
@click.option("--remove", is_flag=True, help="Delete corrupt blobs, tampered records and planted files, and the "
              "entries that use them.")
@click.pass_context
def verify_cmd(ctx, remove):
    """Re-hash every blob and compiled kernel, authenticate every record, and look for what
    titan never makes (links, special files); exit 1 if anything is wrong."""
    from titan.runtime.store.build_cache import cache_layout_problems, remove_planted
    from titan.runtime.store.kernel_store import kernel_store_problems

    root = Path(ctx.obj).expanduser() if ctx.obj else _default_root()
    planted = cache_layout_problems(root) + kernel_store_problems(root / "kernels")
    for problem in planted:
        click.echo(f"tampered: {problem}{' (removed)' if remove else ''}")
    if planted and not remove:
        click.echo(f"verified nothing else: {len(planted)} tampered; titan-cache verify --remove deletes them")
        sys.exit(1)
    if planted:
        remove_planted(root)
        remove_planted(root / "kernels")
    cache = _cache(ctx)
    checked, bad, tampered, others = cache.verify(remove=remove)
    for sha in bad:
        click.echo(f"corrupt: {sha}{' (removed)' if remove else ''}")
    k_checked, k_bad, k_tampered = _kernels(cache).verify(remove=remove)
    for key in k_bad:
        click.echo(f"corrupt kernel: {key}{' (removed; titan-run compiles it again)' if remove else ''}")
    for problem in tampered + k_tampered:
        click.echo(f"tampered: {problem}{' (removed)' if remove else ''}")
    n_tampered = len(planted) + len(tampered) + len(k_tampered)
    theirs = f"; {others} records of other users kept as theirs (not judged with your key)" if others else ""
    click.echo(f"verified {checked} blobs: {len(bad)} corrupt; {k_checked} kernels: {len(k_bad)} corrupt; "
               f"{n_tampered} tampered{theirs}")
    sys.exit(1 if bad or k_bad or n_tampered else 0)


def _default_root() -> Path:
    from titan.runtime.common.environment import cache_root
    return cache_root()


@main.command("gc")
@click.option("--max-size", default=None, help="Shrink the cache to at most this size (e.g. 20G), least recently used first.")
@click.option("--older-than", default=None,
              help="Remove entries, and compiled kernels, unused for longer than this (e.g. 7d, 12h).")
@click.pass_context
def gc_cmd(ctx, max_size, older_than):
    """Remove entries by size and/or age (entries being built are never removed); --older-than
    also removes compiled kernels by their last use (--max-size counts builds only)."""
    if max_size is None and older_than is None:
        raise ValueError("give --max-size SIZE and/or --older-than AGE")
    cache = _cache(ctx)
    result = cache.gc(max_size=parse_size(max_size) if max_size else None,
                      older_than_s=parse_age(older_than) if older_than else None)
    for key in result["removed"]:
        click.echo(f"removed {key[:12]}")
    for key in result["skipped_locked"]:
        click.echo(f"kept {key[:12]} (a build holds it)")
    if older_than:
        removed, freed = _kernels(cache).gc(older_than_s=parse_age(older_than))
        if removed:
            click.echo(f"removed {removed} compiled kernels ({_human(freed)})")
    kernels = _kernel_line(cache)
    click.echo(f"cache size now {_human(result['size'])}" + (f"; {kernels}" if kernels else ""))


if __name__ == "__main__":
    main()

"""titan-build --fuse: regions compiled by titan-run into generated kernels; the kernel store of plans."""

from __future__ import annotations

import pytest

import json
import os
import time

from conftest import cache_record, own, read_metrics, titan
from titan.runtime.contract.artifact import open_artifact


def _fusion_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("fusion: "))


@pytest.mark.slow
def test_fused_regions_compile_at_every_cpu_run_and_stay_close_to_eager(debug_artifact, tmp_path):
    # One rank: two ranks on one CPU share kernel keys and race to write them.
    art = debug_artifact(extra=("--fuse",))
    passes = open_artifact(art).manifest.passes
    assert passes[-1] == "fuse_blocks"  # what a bare --fuse selects
    assert "fuse_exact" not in passes  # its regions are within --fuse's
    listing = titan("build", "--list-passes").stdout
    assert "fuse_blocks [CHANGES NUMERICS (opt-in)]" in listing and "fuse_regions [CHANGES NUMERICS (opt-in)]" in listing
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    first = titan("run", art, "--steps", 3, "--metrics", tmp_path / "a.jsonl", env=env)
    assert first.returncode == 0, first.stderr
    line = _fusion_line(first.stdout)
    # Two identical transformer blocks: the second block's regions reuse the first's kernels.
    assert " 0 loaded from the kernel store" in line and "shared" in line and not line.startswith("fusion: 0 ")
    compiled = int(line.split(": ")[2].split(" compiled")[0])
    assert compiled > 0 and f"({compiled} not stored)" in line
    # CPU kernels have no plan, and nothing else is stored (inductor's artifacts unpickle): the
    # next run compiles them again (from inductor's private cache), to the same losses.
    again = titan("run", art, "--steps", 3, "--metrics", tmp_path / "b.jsonl", env=env)
    assert again.returncode == 0, again.stderr
    assert f"{compiled} compiled, 0 loaded from the kernel store" in _fusion_line(again.stdout)
    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert not list((tmp_path / "cache" / "kernels" / "kernels").glob("*.json"))
    # Fused kernels reduce in their own order: close to eager, and titan-verify says why it differs.
    v = titan("verify", art, "--steps", 3, "--json", tmp_path / "v.json", env=env)
    losses = json.loads((tmp_path / "v.json").read_text())
    for e, g in zip(losses["eager"], losses["artifact"]):
        assert abs(float.fromhex(e) - float.fromhex(g)) <= 1e-5 * abs(float.fromhex(e))
    if v.returncode == 1:
        assert "built with passes that change numerics (fuse_blocks)" in v.stdout


def test_kernel_store_serves_intact_plans_only_and_gc_goes_by_last_use(tmp_path):
    from titan.runtime.kernels.kernel_plan import Kernel, Launch, Output, Plan, encode_plan
    from titan.runtime.store.kernel_store import KernelStore

    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    kernels = tmp_path / "cache" / "kernels"
    store = KernelStore(kernels)
    keys = [f"{i:032x}" for i in range(3)]
    for i, key in enumerate(keys):
        kernel = Kernel(name=f"triton_poi_{i}", cubin=b"\x7fELF" + bytes([i]), shared=0, num_warps=4, arg_types="Oi")
        plan = Plan(kernels=(kernel,), buffers=(256,), inputs=0,
                    launches=(Launch(kernel=0, grid=(1, 1, 1), args=(("buf", 0, 0, 256), 64)),),
                    outputs=(Output(base=("buf", 0), dtype="float32", size=(64,), stride=(1,), offset=0),))
        store.save(key, encode_plan(plan), device="test sm90")
    assert all(store.load(key) is not None for key in keys)
    assert "kernels: 3 compiled regions" in titan("cache", "ls", env=env).stdout
    # An edited kernel fails the digest its authenticated record holds: never served (compiled again).
    sha = cache_record(kernels / "kernels" / f"{own(keys[0])}.json")["sha256"]
    victim = kernels / "blobs" / sha[:2] / sha
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    bad = titan("cache", "verify", env=env)
    assert bad.returncode == 1 and f"corrupt kernel: {keys[0]}" in bad.stdout
    assert KernelStore(kernels).load(keys[0]) is None
    assert titan("cache", "verify", "--remove", env=env).returncode == 1
    assert titan("cache", "verify", env=env).returncode == 0
    # gc goes by last use: kernels loaded since stay; unused ones go.
    old = time.time() - 3 * 86400
    for k in (kernels / "used").iterdir():
        os.utime(k, (old, old))
    assert KernelStore(kernels).load(keys[1]) is not None
    gc = titan("cache", "gc", "--older-than", "1d", env=env)
    assert gc.returncode == 0 and "removed 1 compiled kernels" in gc.stdout, gc.stdout
    assert sorted(p.stem for p in (kernels / "kernels").glob("*.json")) == [own(keys[1])]


@pytest.mark.slow
def test_region_passes_tag_consecutive_runs_and_blocks_cover_more(debug_artifact):
    from titan.runtime.contract.graph_doc import read_doc

    def regions(art):
        a = open_artifact(art, check_torch=False)
        doc = read_doc(a.read_verified(a.rank_entry(0).forward))
        tags = [n.get("region") for n in doc["nodes"]]
        # Each region's nodes are consecutive, so the runtime can cut it out as one call.
        runs = [t for i, t in enumerate(tags) if t and (i == 0 or tags[i - 1] != t)]
        assert len(runs) == len(set(runs))
        return {t.split("#")[0] for t in runs}, sum(t is not None for t in tags)

    kinds, covered = regions(debug_artifact(tp=2, extra=("--fuse", "regions")))
    assert kinds == {"rms_norm", "rope", "swiglu", "loss"}
    block_kinds, block_covered = regions(debug_artifact(tp=2, extra=("--fuse", "blocks")))
    assert block_kinds == {"block"} and block_covered > covered


@pytest.mark.slow
def test_default_exact_regions_hold_only_measured_element_wise_ops_and_stay_eager_on_cpu(debug_artifact, tmp_path):
    from titan.builder.passes.regions import EXACT_OPS
    from titan.runtime.contract.graph_decode import resolve_target, target_name
    from titan.runtime.contract.graph_doc import read_doc

    allowed = {target_name(op) for op in EXACT_OPS}
    seen = set()
    cast_kwargs = set()
    # bf16, as on GPUs (the bucket copy-in casts); FSDP and tensor parallel (its sequence-parallel
    # gathers split lists, which stay outside: a region's results are tensors).
    for art in (debug_artifact(dp_shard=2, extra=("--dtype", "bf16")), debug_artifact(tp=2, extra=("--dtype", "bf16"))):
        a = open_artifact(art, check_torch=False)
        assert a.manifest.passes[-1] == "fuse_exact"
        for kind in ("forward", "backward"):
            nodes = read_doc(a.read_verified(getattr(a.rank_entry(0), kind)))["nodes"]
            tags = [n.get("region") for n in nodes]
            runs = [t for i, t in enumerate(tags) if t and (i == 0 or tags[i - 1] != t)]
            assert runs and len(runs) == len(set(runs)) and all(t.startswith("exact#") for t in runs)
            for n in nodes:
                if n.get("region"):
                    assert n["target"] in allowed or resolve_target(n["target"]).is_view, n["target"]
                    assert "shape" in n["val"], n  # one tensor, never a list
                    seen.add(n["target"])
                    if n["target"] == "aten._to_copy.default":
                        assert set(n["kwargs"]) <= {"dtype", "layout", "device"}, n
                        cast_kwargs |= set(n["kwargs"])
    # RMSNorm's and SwiGLU's element-wise work is in; their reductions and silu_backward are not.
    assert {"aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.silu.default", "aten.cat.default"} <= seen
    assert not seen & {"aten.mean.dim", "aten.sum.dim_IntList", "aten.silu_backward.default", "aten.mm.default"}
    # Traced `.to(dtype)` calls that spell out the (unchanged) layout are plain casts too.
    assert "layout" in cast_kwargs
    # On the CPU the exact regions stay on eager kernels: nothing is compiled (or imported).
    art = debug_artifact(dp_shard=2, extra=("--dtype", "bf16"))
    env = dict(os.environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    r = titan("run", art, "--steps", 2, env=env)
    assert r.returncode == 0, r.stderr
    assert "fusion:" not in r.stdout and not (tmp_path / "cache" / "kernels").exists()


def test_fusion_passes_are_exclusive_and_last(tmp_path):
    base = ("build", "--flavor", "debug", "--out", tmp_path / "x", "--passes")
    both = titan(*base, "mask_index_put_to_where,fuse_exact,fuse_blocks")
    assert both.returncode == 2 and "fuse_exact and fuse_blocks" in both.stderr and "keep one" in both.stderr
    early = titan(*base, "fuse_exact,mask_index_put_to_where")
    assert early.returncode == 2 and "fuse_exact must come last" in early.stderr
    assert not (tmp_path / "x").exists()

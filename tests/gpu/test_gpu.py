"""On CUDA GPUs: the device-dispatched attention op, and artifacts bitwise equal to eager."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import read_metrics, titan, write_documents
from titan.runtime.contract.artifact import open_artifact


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_op_matches_sdpa_on_cuda(dtype):
    import titan.runtime.contract.ops  # noqa: F401

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
               for _ in range(3))
    out = torch.ops.titan.attention(q, k, v)[0]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.gpu(count=1)
def test_cudnn_attention_matches_flash_attention_values_and_layouts():
    from titan.runtime.contract import ops

    g = torch.Generator(device="cuda").manual_seed(0)
    # As the model calls it: q, k, v and the output's gradient are transposes of (b, s, h, d).
    q, k, v, grad = (torch.randn(2, 1024, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                     for _ in range(4))
    if not ops._use_cudnn(q, k, v):
        pytest.skip("cuDNN attention is not available here (needs Hopper or newer)")

    def run():
        out, lse = torch.ops.titan.attention(q, k, v)
        return (out, lse, *torch.ops.titan.attention_backward(grad, q, k, v, out, lse))

    cudnn = run()
    # Deterministic algorithms select flash-attention 2 (cuDNN attention is nondeterministic).
    torch.use_deterministic_algorithms(True)
    try:
        assert not ops._use_cudnn(q, k, v)
        flash = run()
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), cudnn, flash):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")


SYMPY_PROBE = """
import sys, torch
from titan.runtime.contract import ops
q, k, v, grad = (torch.randn(1, 512, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
out, lse = torch.ops.titan.attention(q, k, v)
torch.ops.titan.attention_backward(grad, q, k, v, out, lse)
torch.cuda.synchronize()
print("CUDNN", ops._use_cudnn(q, k, v), "SYMPY", "sympy" in sys.modules)
"""


@pytest.mark.gpu(count=1)
def test_cudnn_attention_backward_imports_no_sympy_and_matches_the_meta_layout():
    """The backward takes the logsumexp layout from its forward, not from aten's meta kernel (whose
    empty_like imports sympy: 3.7 s of a rank's start, issue 30), and the two layouts agree (so the
    kernels run on the same inputs as before)."""
    import subprocess
    import sys

    from titan.runtime.contract import ops

    r = subprocess.run([sys.executable, "-c", SYMPY_PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    if "CUDNN True" not in r.stdout:
        pytest.skip("cuDNN attention is not available here (needs Hopper or newer)")
    assert "SYMPY False" in r.stdout, r.stdout
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    torch.ops.titan.attention(q, k, v)
    recorded = ops._cudnn_lse_layout(q, k, v)
    ops._CUDNN_LSE_LAYOUTS.clear()  # as a backward without its forward in the process: the meta kernel's
    from_meta = ops._cudnn_lse_layout(q, k, v)
    assert (recorded.shape, recorded.stride(), recorded.dtype) == (from_meta.shape, from_meta.stride(), from_meta.dtype)


def _verify_json(art, tmp_path, name, *flags) -> dict:
    out = tmp_path / f"{name}.json"
    r = titan("verify", art, "--steps", 10, "--device", "cuda", "--json", out, *flags)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    # The default passes' exact regions run as kernels generated on this GPU.
    assert any(line.startswith("fusion: ") and " exact)" in line for line in r.stdout.splitlines()), r.stdout
    return json.loads(out.read_text())


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp_shard=2)], ids=["tp2", "dp_shard2"])
def test_cuda_graphs_bitwise_equal_to_eager_and_to_no_graphs(layout, dtype, debug_artifact, tmp_path):
    art = debug_artifact(**layout, extra=("--dtype", dtype))
    with_graphs = _verify_json(art, tmp_path, "graphs")
    without = _verify_json(art, tmp_path, "nographs", "--no-cuda-graphs")
    assert with_graphs["bitwise_equal"] and without["bitwise_equal"]
    assert with_graphs["artifact"] == without["artifact"] == with_graphs["eager"]
    metrics = tmp_path / "metrics.jsonl"
    r = titan("run", art, "--steps", 10, "--device", "cuda", "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    assert [float.fromhex(h) for h in with_graphs["artifact"]] == [rec["loss"] for rec in read_metrics(metrics)]


@pytest.mark.gpu(count=4)
def test_8b_tp4_bf16_cuda_graphs_bitwise_equal_to_eager(tmp_path):
    # At seq 8192 the flash-attention backward accumulates with atomics unless deterministic
    # kernels are asked for: eager then differs from itself run to run, so compare with them.
    art = tmp_path / "llama3-tp4"
    r = titan("build", "--model", "llama3", "--tp", 4, "--out", art)
    assert r.returncode == 0, r.stderr
    result = _verify_json(art, tmp_path, "8b", "--deterministic")
    assert result["bitwise_equal"] and result["eager"] == result["artifact"]


@pytest.mark.gpu(count=1)
def test_the_recipe_in_cuda_graphs_is_bitwise_equal_to_eager(debug_artifact, tmp_path):
    """Warmup, cosine decay, clipping and 2-way accumulation with CUDA graphs: every step's loss
    (a micro-batch's loss is the graph's own buffer, rewritten by the next replay), grad norm
    and validation loss, and every parameter."""
    val = tmp_path / "val.bin"
    torch.randint(0, 2048, (20_000,), dtype=torch.int32).to(torch.int16).numpy().tofile(val)
    result = _verify_json(debug_artifact(), tmp_path, "recipe", "--deterministic", "--warmup-steps", 2,
                          "--decay-type", "cosine", "--min-lr-factor", 0.1, "--max-norm", 0.5,
                          "--accumulation-steps", 2, "--val-data", val, "--val-every", 5)
    assert result["bitwise_equal"] and result["eager"] == result["artifact"]
    assert result["eager_grad_norm"] == result["artifact_grad_norm"]
    assert result["eager_val_loss"] == result["artifact_val_loss"] and len(result["eager_val_loss"]) == 2


@pytest.mark.gpu(count=2)
def test_deterministic_kernels_bitwise_on_cuda(debug_artifact, tmp_path):
    result = _verify_json(debug_artifact(tp=2), tmp_path, "det", "--deterministic")
    assert result["bitwise_equal"] and result["eager"] == result["artifact"]


@pytest.mark.gpu(count=1)
def test_one_kernel_adamw_bitwise_equal_to_torch_single_tensor_adamw():
    from titan.runtime.fused_adamw import FusedAdamW

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1000, 37), (4096,), (3, 5, 7), (1 << 20,), (1,)]
    # Magnitudes from 2^-140 (below float32's normal range) to 2^10: the copies' rounding too.
    params = [torch.randn(s, device="cuda", generator=g)
              * torch.exp2(torch.randint(-140, 10, s, device="cuda", generator=g).float()) for s in shapes]
    ref_params = [p.clone() for p in params]
    # The compute-dtype copies the forward takes (runtime/param_copies.py): some, in both dtypes.
    copies = [torch.empty_like(p, dtype=dtype) if dtype else None
              for p, dtype in zip(params, (torch.bfloat16, None, torch.float16, torch.bfloat16, None))]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g)
    # A step that leaves the parameters as they are writes their copies at every magnitude.
    FusedAdamW(params, copies=copies, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0).step()
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert all(c is None or torch.equal(c, p.to(c.dtype)) for p, c in zip(params, copies))
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = FusedAdamW(params, copies=copies, **hp)
    ref = torch.optim.AdamW(ref_params, foreach=False, **hp)
    for _ in range(6):
        for p, q in zip(params, ref_params):
            scale = torch.exp2(torch.randint(-30, 4, p.shape, device="cuda", generator=g).float())
            p.grad = torch.randn(p.shape, device="cuda", generator=g) * scale
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        for p, q, m, v in zip(params, ref_params, ours.exp_avg, ours.exp_avg_sq):
            assert torch.equal(p, q)
            assert torch.equal(m, ref.state[q]["exp_avg"]) and torch.equal(v, ref.state[q]["exp_avg_sq"])
        for q, copy in zip(ref_params, copies):
            assert copy is None or torch.equal(copy, q.to(copy.dtype))  # the cast the forward made


@pytest.mark.gpu(count=1)
def test_adamw_kernel_compiled_in_background_leaves_the_first_launch_nothing_to_compile(monkeypatch):
    """titan-run starts the update's compile on a thread as it makes the optimizer: every variant
    the parameters take (element counts a multiple of 16 or not; a copy's dtype and its
    gradient's; clipped or not) is compiled there, and the updates it then makes are torch's."""
    from titan.runtime import fused_adamw

    monkeypatch.setattr(fused_adamw, "_kernel", None)
    monkeypatch.setattr(fused_adamw, "_compiling", None)
    shapes = [(1000, 37), (4096,), (3, 5, 7), (1 << 20,)]
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(1)
    params = [torch.randn(s, device="cuda", generator=g) * 0.02 for s in shapes]
    copies = [None, torch.empty_like(params[1], dtype=torch.bfloat16), None, None]
    fused_adamw.start_compiling(device, params, copies, [False, True, False, False], clipped=True)
    kernel = fused_adamw._the_kernel()
    compiled = dict(kernel.device_caches[device.index][0])
    # Four classes (a multiple of 16 or not; with a bf16 copy and an fp32 or a bf16 gradient),
    # each with and without the scale.
    assert len(compiled) == 8

    ref_params = [p.clone() for p in params]
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = fused_adamw.FusedAdamW(params, copies=copies, **hp)
    ref = torch.optim.AdamW(ref_params, foreach=False, **hp)
    for _ in range(2):
        for p, q in zip(params, ref_params):
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    ours.launch(torch.ones((), device="cuda"))  # the clipped variant
    params[1].grad, copies[1].grad = None, torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16)
    ours.launch(torch.ones((), device="cuda"))  # the copy's bf16 gradient, as a captured step leaves it
    assert fused_adamw._the_kernel() is kernel and dict(kernel.device_caches[device.index][0]) == compiled


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("with_copies", [False, True], ids=["fp32-grads", "copies-bf16-grads"])
def test_captured_update_with_the_clip_folded_in_is_bitwise_torch_clip_adamw_and_schedule(with_copies):
    """The optimizer step as titan-run replays it (runtime/captured_update.py): the norm, the clip
    coefficient multiplied in by the AdamW kernel, the LR read from the device, one CUDA graph;
    against clip_grad_norm_, torch's single-tensor AdamW and LambdaLR. The clip acts on some steps
    and not on others; a gradient moved to a new buffer is captured again, never read stale.
    `with_copies`: three parameters have bf16 copies (runtime/param_copies.py) and the step
    leaves their gradients in bf16 on the copies, as a captured step does: the norm and the
    update read those and upcast them, and torch gets the upcast gradients."""
    from titan.runtime.captured_update import CapturedUpdate
    from titan.runtime.fused_adamw import FusedAdamW
    from titan.runtime.grad_clip import GlobalNormClip

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1000, 37), (4096,), (3, 5, 7), (1 << 20,), (1,)]
    params = [torch.randn(s, device="cuda", generator=g) * 0.02 for s in shapes]
    ref_params = [p.clone() for p in params]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) if with_copies and i in (0, 2, 3) else None
              for i, p in enumerate(params)]
    for p, c in zip(params, copies):
        if c is not None:
            c.copy_(p)
    hp = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    factor = lambda step: min(1.0, (step + 1) / 3) * (0.5 if step >= 5 else 1.0)  # noqa: E731
    schedule = type("Schedule", (), {"lr_at": staticmethod(lambda step: 3e-3 * factor(step))})()
    ours = FusedAdamW(params, lr=3e-3, schedule=schedule, copies=copies, **hp)
    ref = torch.optim.AdamW(ref_params, lr=3e-3, foreach=False, **hp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(ref, factor)
    max_norm = 5.0
    update = CapturedUpdate(GlobalNormClip([{} for _ in params], None, max_norm=max_norm), ours)

    def buffers():
        return [torch.empty_like(p, dtype=torch.float32 if c is None else c.dtype) for p, c in zip(params, copies)]
    grads = buffers()
    clipped = []
    for step in range(8):
        if step == 6:  # new gradient buffers: a new capture
            grads = buffers()
        for p, q, c, buf in zip(params, ref_params, copies, grads):
            scale = torch.exp2(torch.randint(-30, 4, p.shape, device="cuda", generator=g).float())
            buf.copy_(torch.randn(p.shape, device="cuda", generator=g) * scale * (1e-6 if step % 2 else 1.0))
            if c is None:
                p.grad, q.grad = buf, buf.clone()
            else:
                p.grad, c.grad, q.grad = None, buf, buf.float()
        norm = update()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, foreach=True)
        ref.step()
        scheduler.step()
        assert torch.equal(norm, ref_norm)
        clipped.append(bool(ref_norm > max_norm))
        for p, q, m, v, c in zip(params, ref_params, ours.exp_avg, ours.exp_avg_sq, copies):
            assert torch.equal(p, q)
            assert torch.equal(m, ref.state[q]["exp_avg"]) and torch.equal(v, ref.state[q]["exp_avg_sq"])
            assert c is None or torch.equal(c, q.to(c.dtype))
    assert any(clipped) and not all(clipped)
    update.close()


def _fusion_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("fusion: "))


@pytest.mark.gpu(count=1)
def test_second_run_loads_every_kernel_and_compiles_none(tmp_path):
    env = dict(__import__("os").environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    art = tmp_path / "art"
    assert titan("build", "--flavor", "debug", "--dtype", "bf16", "--out", art, env=env).returncode == 0
    first = titan("run", art, "--steps", 2, "--device", "cuda", env=env)
    assert first.returncode == 0, first.stderr
    assert " 0 compiled" not in _fusion_line(first.stdout)
    second = titan("run", art, "--steps", 2, "--device", "cuda", env=env)
    assert second.returncode == 0, second.stderr
    line = _fusion_line(second.stdout)
    # Every kernel comes back as a plan (runtime/kernels/kernel_plan.py): inductor is never imported.
    assert " 0 compiled" in line and "as kernel plans" in line and "inductor not loaded" in line, line


@pytest.mark.gpu(count=1)
def test_kernels_loaded_as_plans_train_bitwise_equal_to_eager(tmp_path):
    env = dict(__import__("os").environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    art = tmp_path / "art"
    assert titan("build", "--flavor", "debug", "--dtype", "bf16", "--out", art, env=env).returncode == 0
    assert titan("run", art, "--steps", 1, "--device", "cuda", env=env).returncode == 0  # compiles, stores plans
    out = tmp_path / "verify.json"
    r = titan("verify", art, "--steps", 10, "--device", "cuda", "--json", out, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "as kernel plans" in _fusion_line(r.stdout), r.stdout
    result = json.loads(out.read_text())
    assert result["bitwise_equal"] and result["eager"] == result["artifact"]


@pytest.mark.gpu(count=1)
def test_artifact_built_with_kernels_runs_on_an_empty_cache_without_compiling(tmp_path):
    import shutil

    env = dict(__import__("os").environ, TITAN_CACHE_DIR=str(tmp_path / "cache"))
    art, key = tmp_path / "art", tmp_path / "team.key"
    r = titan("build", "--flavor", "debug", "--dtype", "bf16", "--kernels", "--sign", key, "--out", art, env=env)
    assert r.returncode == 0, r.stderr
    manifest = open_artifact(art).manifest
    assert manifest.kernels and all(rel in manifest.files for rel in manifest.kernels.values())
    copied = tmp_path / "copied"
    shutil.copytree(art, copied)
    # Another user's machine (their own key and cache) that trusts the signer's key.
    fresh = dict(env, TITAN_CACHE_DIR=str(tmp_path / "empty-cache"), TITAN_KEY_FILE=str(tmp_path / "other" / "k"))
    run = titan("run", copied, "--steps", 2, "--device", "cuda", "--trust", key, env=fresh)
    assert run.returncode == 0, run.stderr
    assert "are signed by a key you trust" in run.stdout, run.stdout
    line = _fusion_line(run.stdout)
    assert " 0 compiled" in line and " 0 loaded from the kernel store" in line, line
    assert "inductor not loaded" in line, line
    # Without --trust the same copy's kernels are ignored in one line and compiled there.
    untrusted = dict(fresh, TITAN_CACHE_DIR=str(tmp_path / "empty-cache-2"))
    run = titan("run", copied, "--steps", 2, "--device", "cuda", env=untrusted)
    assert run.returncode == 0, run.stderr
    assert "which you did not --trust" in run.stdout, run.stdout
    assert " 0 from the artifact" in _fusion_line(run.stdout)

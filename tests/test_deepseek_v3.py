"""DeepSeek-V3 and its expert-parallel dispatch: the same step on one rank and on two expert-
parallel gloo ranks, and a dispatch that traces to static shapes with no host synchronization
(Hugging Face checkpoints: test_deepseek_v3_hf.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan.builder.models.deepseek_v3.config import FLAVORS
from titan.builder.models.moe.dispatch import make_plan
from titan.builder.models.moe.expert_parallel import is_expert_param, set_dispatch
from titan.builder.models.deepseek_v3 import SPEC
from titan.builder.models.deepseek_v3.init import init_specs
from titan.builder.models.deepseek_v3.model import DeepSeekV3
from titan.runtime.init import full_param

CFG = FLAVORS["debug"]
BATCH, SEQ = 4, 16
WORKER = Path(__file__).with_name("deepseek_ep_worker.py")


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Global weights drawn as the runtime draws them."""
    shapes = {fqn: list(p.shape) for fqn, p in DeepSeekV3(CFG).named_parameters()}
    return {fqn: full_param(spec, shapes[fqn], fqn=fqn, seed=seed, device=torch.device("cpu"))
            for fqn, spec in init_specs(CFG).items()}


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)}


def _single_rank_step(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> DeepSeekV3:
    model = DeepSeekV3(CFG)
    model.load_state_dict(state, strict=False)
    model.loss_scale = float(batch["tokens"].numel())
    set_dispatch(model, tokens=batch["tokens"].numel())
    model.last_loss = model(batch["tokens"], batch["labels"])
    model.last_loss.backward()
    return model


def _run_ep_ranks(work: Path, state: dict, batch: dict, *, world: int = 2, extra: tuple = ()) -> list[dict]:
    """Run the eager step on `world` expert-parallel gloo ranks (real processes)."""
    work.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, work / "weights.safetensors")
    save_file(batch, work / "batch.safetensors")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(work), *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    return [load_file(work / f"rank{r}.safetensors") for r in range(world)]


@pytest.mark.parametrize("world,ep,ac", [(2, 2, "none"), (4, 2, "full")], ids=["ep2", "dp2xep2-ac-full"])
def test_expert_parallel_step_matches_single_rank_and_its_graphs_match_eager(tmp_path, world, ep, ac):
    """ep=2 (each rank: half the batch, half the experts) and data parallel 2 x ep=2 (each rank
    a quarter of the batch, half the experts, replicated twice) against one rank with everything;
    and on every rank, the step as exported graphs (forward + backward, written in the titan
    graph format and read back; the second with full activation checkpointing, so the backward
    recomputes the routing and the dispatch) against the eager step: bitwise, loss, every
    gradient and every MoE buffer (the balancing-bias update included).

    Not bitwise: the two ranks' losses and data-parallel gradients are summed across ranks in a
    different order than one rank sums them, and each expert's GEMM sees a different row count
    (its per-row results may round differently). Observed differences are ~1e-7 relative; the
    tolerance is float32 rounding of such reorderings. What involves only integers is bitwise:
    the expert loads and therefore the balancing-bias update.
    """
    state, batch = _weights(), _batch()
    ref = _single_rank_step(state, batch)
    ranks = _run_ep_ranks(tmp_path / "ep", state, batch, world=world, extra=("--ep", str(ep), "--graph", "--ac", ac))
    for rank, out in enumerate(ranks):
        eager = sorted(k for k in out if k.startswith("eager."))
        assert [k.replace("eager.", "graph.", 1) for k in eager] == sorted(k for k in out if k.startswith("graph."))
        for key in eager:
            assert torch.equal(out[key], out[key.replace("eager.", "graph.", 1)]), f"rank {rank}: {key}"
    ref_grads = {fqn: p.grad for fqn, p in ref.named_parameters()}
    ref_buffers = dict(ref.named_buffers())
    for rank, out in enumerate(ranks):
        torch.testing.assert_close(out["eager.loss"], ref.last_loss.detach(), rtol=1e-6, atol=0)
        for fqn, grad in ref_grads.items():
            if is_expert_param(fqn):
                per_rank = grad.shape[0] // ep
                grad = grad[rank % ep * per_rank:(rank % ep + 1) * per_rank]
            torch.testing.assert_close(out["eager.grad." + fqn], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{fqn}: {m}")
        for fqn, buf in ref_buffers.items():
            assert torch.equal(out["eager.buffer." + fqn], buf), f"{fqn} differs on rank {rank}"
    assert int(ranks[0]["eager.buffer.layers.1.feed_forward.tokens_per_expert"].sum()) == BATCH * SEQ * CFG.top_k


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_spec_initializes_every_parameter_of_each_flavor(flavor):
    cfg = FLAVORS[flavor]
    with torch.device("meta"):
        model = SPEC.build(cfg)
    assert set(SPEC.init_specs(cfg)) == {fqn for fqn, _ in model.named_parameters()}
    assert SPEC.config_from_dict(cfg.as_dict()) == cfg
    assert len(model.moe_layers()) == cfg.n_moe_layers


def test_spec_refuses_layouts_it_cannot_build():
    from titan.runtime.contract.layout import Layout

    SPEC.check_layout(CFG, Layout(dp_shard=2, ep=2, tp=2))
    with pytest.raises(ValueError, match=r"--tp 3 does not divide the attention heads \(4\)"):
        SPEC.check_layout(CFG, Layout(tp=3))
    with pytest.raises(ValueError, match=r"--ep 3 does not divide the routed experts \(8\)"):
        SPEC.check_layout(CFG, Layout(ep=3))
    with pytest.raises(ValueError, match=r"--dp-shard 3 does not divide the embedding rows \(512\)"):
        SPEC.check_layout(CFG, Layout(dp_shard=3))


def test_graph_reader_resolves_the_grouped_gemm_without_model_code():
    """A runtime process (no builder or model import) can load graphs that call titan::grouped_mm."""
    code = ("import sys; from titan.runtime.contract.graph_decode import resolve_target; "
            "print(resolve_target('titan.grouped_mm.default')); "
            "assert not [m for m in sys.modules if m.startswith('titan.builder')]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "titan.grouped_mm.default" in r.stdout


def test_dispatch_plan_sizes():
    """Dropless blocks hold every assignment a rank can send one peer; a capacity factor sizes
    them from the balanced load, never beyond the dropless bound."""
    dropless = make_plan(n_experts=8, ep=2, tokens=32, top_k=3)
    assert (dropless.capacity, dropless.buffer_rows, dropless.dropless) == (32 * 3, 2 * 32 * 3, True)
    # A token reaches at most experts_per_rank distinct experts on one peer.
    assert make_plan(n_experts=8, ep=4, tokens=32, top_k=3).capacity == 32 * 2
    capped = make_plan(n_experts=8, ep=2, tokens=32, top_k=3, capacity_factor=1.25)
    assert (capped.capacity, capped.dropless) == (60, False)
    assert make_plan(n_experts=8, ep=2, tokens=32, top_k=3, capacity_factor=10.0).capacity == 96
    with pytest.raises(ValueError, match="does not divide the 8 routed experts"):
        make_plan(n_experts=8, ep=3, tokens=32, top_k=3)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="capacity factor must be a positive number"):
            make_plan(n_experts=8, ep=2, tokens=32, top_k=3, capacity_factor=bad)


def _skewed_bias() -> dict[str, torch.Tensor]:
    """Balancing biases that send every token of every MoE layer to experts 0, 1 and 2, all
    held by expert-parallel rank 0: the worst case the dropless bound is sized for."""
    bias = torch.zeros(CFG.n_routed_experts)
    bias[:CFG.top_k] = 10.0
    return {f"layers.{i}.feed_forward.expert_bias": bias.clone() for i in range(CFG.n_dense_layers, CFG.n_layers)}


def test_worst_case_routing_is_dropless_by_default(tmp_path):
    state, batch = {**_weights(), **_skewed_bias()}, _batch()
    ref = _single_rank_step(state, batch)
    ranks = _run_ep_ranks(tmp_path / "skew", state, batch)
    tokens = BATCH * SEQ
    for out in ranks:
        for i in range(CFG.n_dense_layers, CFG.n_layers):
            load = out[f"eager.buffer.layers.{i}.feed_forward.tokens_per_expert"]
            assert load.tolist() == [tokens] * CFG.top_k + [0] * (CFG.n_routed_experts - CFG.top_k)
            assert int(out[f"eager.buffer.layers.{i}.feed_forward.dropped_tokens"]) == 0
        torch.testing.assert_close(out["eager.loss"], ref.last_loss.detach(), rtol=1e-6, atol=0)


def test_capacity_overflow_is_counted_and_reported(tmp_path):
    """Capacity factor 1: each (source, destination) block holds the balanced share
    tokens * top_k / ep; with everything routed to rank 0, half of each rank's assignments
    overflow, and every rank reports the global count after the step."""
    state, batch = {**_weights(), **_skewed_bias()}, _batch()
    world = 2
    ranks = _run_ep_ranks(tmp_path / "cap", state, batch, world=world, extra=("--capacity-factor", "1.0"))
    per_rank_assignments = BATCH * SEQ // world * CFG.top_k
    capacity = per_rank_assignments // world
    for out in ranks:
        assert torch.isfinite(out["eager.loss"])
        for i in range(CFG.n_dense_layers, CFG.n_layers):
            dropped = int(out[f"eager.buffer.layers.{i}.feed_forward.dropped_tokens"])
            assert dropped == world * (per_rank_assignments - capacity)


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_step_captures_in_a_cuda_graph(dtype):
    """The whole step, dispatch included, captures in a CUDA graph (a host sync would abort the
    capture) and one replay equals one eager step: the loss and the MoE buffers (balancing bias,
    loads) exactly, the gradients to rounding (the CUDA attention backward accumulates
    atomically)."""
    cuda = torch.device("cuda")
    probe = (torch.zeros(8, 16, device=cuda, dtype=dtype), torch.zeros(2, 16, 16, device=cuda, dtype=dtype),
             torch.tensor([4, 8], device=cuda, dtype=torch.int32))
    try:  # aten's CUDA grouped GEMM: bfloat16 kernels; other dtypes may be missing or sync on the host
        torch._grouped_mm(*probe[:2], offs=probe[2])
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch._grouped_mm(*probe[:2], offs=probe[2])
    except RuntimeError as e:
        pytest.skip(f"this torch's CUDA grouped GEMM cannot run {dtype} in a CUDA graph: {e}")
    state, batch = _weights(), {k: v.to(cuda) for k, v in _batch().items()}

    def make() -> DeepSeekV3:
        model = DeepSeekV3(CFG)
        model.load_state_dict(state, strict=False)
        model.to(device=cuda, dtype=dtype)
        for moe in model.moe_layers():
            moe.expert_bias.data = moe.expert_bias.float()
        model.loss_scale = float(batch["tokens"].numel())
        set_dispatch(model, tokens=batch["tokens"].numel())
        return model

    def step(model: DeepSeekV3) -> torch.Tensor:
        loss = model(batch["tokens"], batch["labels"])
        loss.backward()
        return loss

    eager, captured = make(), make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (allocates the gradients), on both models alike
        for model in (eager, captured):
            step(model)
            for p in model.parameters():
                p.grad.zero_()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = step(captured)
    graph.replay()
    eager_loss = step(eager)
    torch.cuda.synchronize()
    assert torch.equal(captured_loss, eager_loss)
    for (name, a), b in zip(captured.named_buffers(), eager.buffers()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(captured.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"{name}: {m}")

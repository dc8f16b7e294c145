"""DeepSeek-V3 and its expert-parallel dispatch: the same step on one rank and on expert-parallel
gloo ranks (real processes), and a runtime process that reads its grouped GEMM without model
code (the spec and the dispatch plan: unit/test_deepseek_v3_spec.py; Hugging Face checkpoints:
test_deepseek_v3_hf.py; the CUDA graph capture: gpu/test_deepseek_v3_cuda_graph.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deepseek_debug import BATCH, CFG, SEQ, debug_batch, debug_weights, run_ep_ranks, single_rank_step
from titan.builder.models.moe import is_expert_param


@pytest.mark.parametrize("world,ep,ac", [(2, 2, "none"), pytest.param(4, 2, "full", marks=pytest.mark.slow)],
                         ids=["ep2", "dp2xep2-ac-full"])
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
    state, batch = debug_weights(), debug_batch()
    ref = single_rank_step(state, batch)
    ranks = run_ep_ranks(tmp_path / "ep", state, batch, world=world, extra=("--ep", str(ep), "--graph", "--ac", ac))
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


def test_graph_reader_resolves_the_grouped_gemm_without_model_code():
    """A runtime process (no builder or model import) can load graphs that call titan::grouped_mm."""
    code = ("import sys; from titan.runtime.contract.graph_decode import resolve_target; "
            "print(resolve_target('titan.grouped_mm.default')); "
            "assert not [m for m in sys.modules if m.startswith('titan.builder')]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "titan.grouped_mm.default" in r.stdout


def _skewed_bias() -> dict[str, torch.Tensor]:
    """Balancing biases that send every token of every MoE layer to experts 0, 1 and 2, all
    held by expert-parallel rank 0: the worst case the dropless bound is sized for."""
    bias = torch.zeros(CFG.n_routed_experts)
    bias[:CFG.top_k] = 10.0
    return {f"layers.{i}.feed_forward.expert_bias": bias.clone() for i in range(CFG.n_dense_layers, CFG.n_layers)}


def test_worst_case_routing_is_dropless_by_default(tmp_path):
    state, batch = {**debug_weights(), **_skewed_bias()}, debug_batch()
    ref = single_rank_step(state, batch)
    ranks = run_ep_ranks(tmp_path / "skew", state, batch)
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
    state, batch = {**debug_weights(), **_skewed_bias()}, debug_batch()
    world = 2
    ranks = run_ep_ranks(tmp_path / "cap", state, batch, world=world, extra=("--capacity-factor", "1.0"))
    per_rank_assignments = BATCH * SEQ // world * CFG.top_k
    capacity = per_rank_assignments // world
    for out in ranks:
        assert torch.isfinite(out["eager.loss"])
        for i in range(CFG.n_dense_layers, CFG.n_layers):
            dropped = int(out[f"eager.buffer.layers.{i}.feed_forward.dropped_tokens"])
            assert dropped == world * (per_rank_assignments - capacity)

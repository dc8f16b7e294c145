"""Token dispatch for routed experts: statically sized buffers, no host synchronization.

Every (token, chosen expert) pair is an *assignment*. A rank sorts its assignments by expert,
sends each expert-parallel peer the block of assignments for the experts that peer holds, the
peer runs its experts on what it received with grouped GEMMs, and the results travel back and
are summed per token with the routing weights.

Why static buffers: the number of assignments per peer is data dependent. Reading it on the
host (`.tolist()` for the split sizes, as torchtitan's default dispatch does) stalls the stream
and cannot be captured in a CUDA graph; an ahead-of-time graph needs static shapes anyway. So
every (source, destination) pair gets a block of exactly `capacity` rows, the all-to-all has
equal splits, and the real counts travel on the device beside the rows:

- Dropless (default): a token chooses `top_k` distinct experts, so it sends at most
  min(top_k, experts per rank) rows to one peer; `capacity = tokens * min(top_k, experts per
  rank)` can never overflow. The receive buffer then holds ep * capacity rows: memory for the
  worst case that every rank routes everything to one rank.
- Capacity factor (opt-in): `capacity = ceil(factor * tokens * top_k / ep)` rows. Assignments
  past a block's capacity are dropped (they contribute zero, like a token that skipped the
  expert); the dropped count is computed on the device and reported after the step.

Everything here is sort, searchsorted, gather and where on the device, and the experts run as
grouped GEMMs (`titan::grouped_mm`, runtime/contract/grouped_mm.py) driven by device offsets: traced
graphs have static shapes and no `.item()`, `.tolist()`, `nonzero` or host copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from titan.runtime.contract.grouped_mm import grouped_mm


@dataclass(kw_only=True, frozen=True)
class DispatchPlan:
    """The static sizes of one MoE layer's dispatch on one rank."""

    n_experts: int
    """Routed experts in the layer (all ranks together)."""
    ep: int
    """Expert-parallel degree: ranks the experts are spread over."""
    tokens: int
    """Tokens this rank routes per step."""
    top_k: int
    """Experts per token."""
    capacity: int
    """Rows per (source rank, destination rank) block of the all-to-all buffers."""

    @property
    def experts_per_rank(self) -> int:
        return self.n_experts // self.ep

    @property
    def dropless(self) -> bool:
        return self.capacity >= dropless_capacity(self.tokens, self.top_k, self.experts_per_rank)

    @property
    def buffer_rows(self) -> int:
        """Rows of each send / receive buffer (ep blocks of `capacity`)."""
        return self.ep * self.capacity


def dropless_capacity(tokens: int, top_k: int, experts_per_rank: int) -> int:
    """The most assignments one rank can send one peer: each token picks distinct experts."""
    return tokens * min(top_k, experts_per_rank)


def make_plan(*, n_experts: int, ep: int, tokens: int, top_k: int,
              capacity_factor: float | None = None) -> DispatchPlan:
    """The dropless plan, or (capacity_factor given) one with `factor` times the balanced load
    per block, never more than the dropless bound."""
    if n_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {n_experts} routed experts; pick an --ep that divides it")
    bound = dropless_capacity(tokens, top_k, n_experts // ep)
    if capacity_factor is None:
        capacity = bound
    else:
        if not 0 < capacity_factor < math.inf:
            raise ValueError(f"the capacity factor must be a positive number, got {capacity_factor}; e.g. 1.25")
        capacity = min(bound, max(1, math.ceil(capacity_factor * tokens * top_k / ep)))
    return DispatchPlan(n_experts=n_experts, ep=ep, tokens=tokens, top_k=top_k, capacity=capacity)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Equal-split all-to-all over the expert-parallel group (identity without one)."""
    if group is None:
        return x
    return funcol.all_to_all_single_autograd(x, None, None, group)


def _grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    w3: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert: rows offsets[j-1]:offsets[j] go to expert j.
    Rows past offsets[-1] (the unused tail of the static buffer) come out zero."""
    h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offsets)) * grouped_mm(x, w3.transpose(-2, -1), offsets)
    return grouped_mm(h, w2.transpose(-2, -1), offsets)


def _rows_or_zero(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """src[index] where valid, a zero row elsewhere: invalid entries read an appended zero row,
    so no index is clamped onto a real row and every real row's gradient is a plain sum."""
    padded = torch.cat([src, src.new_zeros(1, src.shape[-1])])
    return padded[torch.where(valid, index, src.shape[0])]


@dataclass(kw_only=True)
class DispatchResult:
    out: torch.Tensor
    """(tokens, dim): the weighted sum of each token's routed experts."""
    tokens_per_expert: torch.Tensor
    """(n_experts,) int64: this rank's assignments per expert (before any drop)."""
    dropped: torch.Tensor
    """() int64: this rank's assignments dropped for capacity (always 0 when dropless)."""


def dispatch_and_combine(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, *,
                         plan: DispatchPlan, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                         group: dist.ProcessGroup | None) -> DispatchResult:
    """Run the routed experts for this rank's tokens.

    x: (tokens, dim); expert_ids, weights: (tokens, top_k); w1/w3: (experts_per_rank, hidden,
    dim) and w2: (experts_per_rank, dim, hidden), this rank's experts; group: the
    expert-parallel process group (None when ep == 1).
    """
    tokens, k = expert_ids.shape
    assert tokens == plan.tokens and k == plan.top_k, (expert_ids.shape, plan)
    ep, cap, local = plan.ep, plan.capacity, plan.experts_per_rank
    device = x.device
    n_assign = tokens * k

    # Sort the assignments by expert: each destination's share is then one contiguous run.
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    expert_start = torch.searchsorted(flat[order], torch.arange(plan.n_experts + 1, device=device))
    tokens_per_expert = expert_start.diff()
    # Explicit slice ends: the graph format bounds integers, and an open end is sys.maxsize.
    rank_start = expert_start[0:plan.n_experts + 1:local]  # (ep + 1,)

    # Send block of destination r, slot c: sorted assignment rank_start[r] + c, if it exists.
    slot = torch.arange(cap, device=device)
    pos = rank_start[:-1, None] + slot  # (ep, cap)
    sent = slot < rank_start.diff()[:, None]
    # Gather from one row per assignment, not per token: every real row is then read at most
    # once, so the gather's backward adds one value per row. Gathering a token's row k times
    # would make the backward a scatter-add with repeated indices, which CPU kernels run with
    # parallel atomic adds: gradients that change from run to run in the last bits.
    x_assign = x[:, None, :].expand(tokens, k, x.shape[-1]).reshape(n_assign, x.shape[-1])
    send = _rows_or_zero(x_assign, order[pos.clamp(max=n_assign - 1)], sent).flatten(0, 1)

    # Per (destination, expert) counts of the rows that fit in the block; the rest is dropped.
    block_offset = (expert_start[:-1] - rank_start[:-1].repeat_interleave(local)).view(ep, local)
    kept = ((block_offset + tokens_per_expert.view(ep, local)).clamp(max=cap) - block_offset).clamp(min=0)
    dropped = n_assign - kept.sum()

    recv = _all_to_all(send, group)  # (ep * cap, dim): block s holds source s's rows
    recv_counts = kept if group is None else funcol.all_to_all_single(kept.flatten(), None, None, group).view(ep, local)

    # Each source's block is sorted by expert; regroup all rows expert-major (sources in order
    # within an expert) for the grouped GEMMs, padding rows last.
    ends = recv_counts.cumsum(1)
    expert_of_row = torch.searchsorted(ends, slot.expand(ep, cap).contiguous(), right=True)  # local for padding
    by_expert = torch.argsort(expert_of_row.flatten(), stable=True)
    offsets = recv_counts.sum(0).cumsum(0).to(torch.int32)
    y = _grouped_swiglu(recv[by_expert], offsets, w1, w2, w3)
    back = _all_to_all(y[torch.argsort(by_expert)], group)  # (ep * cap, dim), source layout

    # Assignment (t, j) sits at sorted position p; its row came back in block r at p - rank_start[r].
    sorted_pos = torch.argsort(order)
    dest = flat // local
    slot_of = sorted_pos - rank_start[dest]
    kept_assign = slot_of < cap
    y_assign = _rows_or_zero(back, dest * cap + slot_of, kept_assign)
    out = (y_assign.view(tokens, k, -1) * weights[..., None].to(y_assign.dtype)).sum(1)
    return DispatchResult(out=out, tokens_per_expert=tokens_per_expert, dropped=dropped)

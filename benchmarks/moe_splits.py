"""A DeepSeek-like MoE token dispatch + combine over expert-parallel GPUs, timed four ways
(issue 32: what device-side split sizes would buy against titan's static buffers):

  host-splits   the split sizes read on the host (.tolist()) and all_to_all_single with them:
                torchtitan's dropless dispatch; one host sync per dispatch, no CUDA graph
  static        titan's dispatch today: every (source, destination) block `capacity` rows,
                equal-split all_to_all_single, the real counts beside the rows; dropless
                (capacity = tokens x min(top_k, experts per rank), the worst case) and
                capacity 1.25 (titan-build --moe-capacity 1.25); no host sync
  vdev          device-side split sizes: torch.ops.symm_mem.all_to_all_vdev (NVSHMEM symmetric
                memory): only the real rows move, the splits never leave the device; the
                receive buffer is still sized for the worst case

The experts are left out (identity): what is timed is the dispatch's own work, the sort by
expert, the packing, the two all-to-alls and the weighted sum back per token. Every way's
combined output is checked equal to the host-split one (identity experts: each token's
weighted sum of its own row, in the same order).

    torchrun --standalone --nproc-per-node 2 benchmarks/moe_splits.py [--tokens 8192 --dim 2048 --experts 64 --top-k 6]

Prints one table on rank 0: ms per dispatch + combine (eager, and replayed from a CUDA graph
where it can be captured), host syncs, rows moved, buffer rows. A way that cannot run here
gets a one-line reason in its row. Without 2 CUDA GPUs it says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens routed per rank")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--capacity", type=float, default=1.25, help="the bounded row's capacity factor")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args()


class Routing:
    """One rank's routing: each token's top_k experts (random, seeded per rank) and weights,
    the assignments sorted by destination rank (stable), and the per-destination counts."""

    def __init__(self, args, rank: int, ep: int, device):
        g = torch.Generator(device="cpu").manual_seed(1234 + rank)
        logits = torch.randn(args.tokens, args.experts, generator=g)
        ids = logits.topk(args.top_k, dim=-1).indices
        self.x = torch.randn(args.tokens, args.dim, generator=g).to(device, torch.bfloat16)
        self.weights = torch.rand(args.tokens, args.top_k, generator=g).to(device, torch.float32)
        self.expert_ids = ids.to(device)
        self.ep, self.per_rank, self.top_k = ep, args.experts // ep, args.top_k


def sort_by_destination(r: Routing):
    """(order, per-destination counts, destination start offsets) of the flat assignments."""
    flat = r.expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    dest_start = torch.searchsorted(flat[order], torch.arange(0, r.ep * r.per_rank + 1, r.per_rank,
                                                              device=flat.device))
    return order, dest_start.diff(), dest_start


def assignment_rows(r: Routing) -> torch.Tensor:
    k = r.top_k
    return r.x[:, None, :].expand(-1, k, -1).reshape(-1, r.x.shape[-1])


def combine(r: Routing, back_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """back_sorted: each assignment's (expert) output in sorted order -> per token weighted sum."""
    y = back_sorted[torch.argsort(order)]
    return (y.view(r.x.shape[0], r.top_k, -1).float() * r.weights[..., None]).sum(1)


def host_splits(r: Routing, group) -> torch.Tensor:
    order, counts, _ = sort_by_destination(r)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_splits, recv_splits = counts.tolist(), recv_counts.tolist()  # the host sync
    send = assignment_rows(r)[order]
    recv = send.new_empty(sum(recv_splits), send.shape[-1])
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, send_splits, recv_splits, group=group)
    return combine(r, back, order)


def static_blocks(r: Routing, group, capacity: int) -> torch.Tensor:
    """titan's dispatch (builder/models/moe/dispatch.py) without the experts: blocks of
    `capacity` rows per destination, equal splits, counts beside the rows; rows past a block
    are dropped (never, at the dropless capacity)."""
    order, counts, dest_start = sort_by_destination(r)
    n = order.numel()
    slot = torch.arange(capacity, device=order.device)
    pos = dest_start[:-1, None] + slot
    sent = slot < counts[:, None]
    rows = assignment_rows(r)
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
    send = padded[torch.where(sent, order[pos.clamp(max=n - 1)], n)].flatten(0, 1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    kept = counts.clamp(max=capacity)
    recv_counts = torch.empty_like(kept)
    dist.all_to_all_single(recv_counts, kept, group=group)
    back = torch.empty_like(recv)
    dist.all_to_all_single(back, recv, group=group)  # identity experts: the received rows go back
    sorted_pos = torch.argsort(order)
    dest = r.expert_ids.flatten() // r.per_rank
    slot_of = sorted_pos - dest_start[dest]
    back_padded = torch.cat([back, back.new_zeros(1, back.shape[-1])])
    y = back_padded[torch.where(slot_of < capacity, dest * capacity + slot_of, back.shape[0])]
    return (y.view(r.x.shape[0], r.top_k, -1).float() * r.weights[..., None]).sum(1)


class DeviceSplits:
    """all_to_all_vdev on NVSHMEM symmetric buffers: the send buffer holds this rank's sorted
    assignments, the receive buffer the worst case (every peer sends everything here)."""

    def __init__(self, r: Routing, group, world: int):
        import torch.distributed._symmetric_memory as symm_mem
        if not symm_mem.is_nvshmem_available():
            raise RuntimeError("NVSHMEM is not available to this torch")
        symm_mem.set_backend("NVSHMEM")
        self.group_name = group.group_name
        symm_mem.enable_symm_mem_for_group(self.group_name)
        n, dim, dev = r.x.shape[0] * r.top_k, r.x.shape[-1], r.x.device
        worst = world * r.x.shape[0] * min(r.top_k, r.per_rank)
        self.send = symm_mem.empty(n, dim, dtype=torch.bfloat16, device=dev)
        self.recv = symm_mem.empty(worst, dim, dtype=torch.bfloat16, device=dev)
        self.back = symm_mem.empty(n, dim, dtype=torch.bfloat16, device=dev)
        self.in_splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
        self.out_splits_offsets = symm_mem.empty(2, world, dtype=torch.int64, device=dev)
        self.back_in_splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
        self.back_splits_offsets = symm_mem.empty(2, world, dtype=torch.int64, device=dev)
        for t in (self.send, self.recv, self.back, self.in_splits, self.out_splits_offsets, self.back_in_splits,
                  self.back_splits_offsets):
            symm_mem.rendezvous(t, group=self.group_name)
        self.buffer_rows = worst

    def __call__(self, r: Routing) -> torch.Tensor:
        order, counts, _ = sort_by_destination(r)
        self.send.copy_(assignment_rows(r)[order])
        self.in_splits.copy_(counts)
        torch.ops.symm_mem.all_to_all_vdev(self.send, self.recv, self.in_splits, self.out_splits_offsets,
                                           self.group_name)
        # Identity experts: what came from each source goes back to it, in the same order.
        self.back_in_splits.copy_(self.out_splits_offsets[0])
        torch.ops.symm_mem.all_to_all_vdev(self.recv, self.back, self.back_in_splits, self.back_splits_offsets,
                                           self.group_name)
        return combine(r, self.back, order)


def timed(fn, *, iters: int, warmup: int) -> float:
    """Median ms of fn() (CUDA events, every rank in step: a barrier before each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def captured(fn, *, iters: int, warmup: int, expect: torch.Tensor):
    """(ms per replay, None) when fn captures in a CUDA graph and its replay equals `expect`,
    else (None, why)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return None, f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    if not torch.equal(out, expect):
        return None, "replay differs from eager"
    return timed(graph.replay, iters=iters, warmup=warmup), None


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("skip: needs 2 CUDA GPUs (run under torchrun --nproc-per-node 2 on a GPU host)")
        return 0
    if "RANK" not in os.environ:
        print("skip: run it under torchrun --standalone --nproc-per-node 2 (one process per GPU)")
        return 0
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if args.experts % world:
        raise SystemExit(f"error: --experts {args.experts} must be divisible by the {world} ranks")
    r = Routing(args, rank, world, torch.device("cuda", local))
    n = args.tokens * args.top_k
    dropless = args.tokens * min(args.top_k, args.experts // world)
    bounded = min(dropless, math.ceil(args.capacity * n / world))
    kw = dict(iters=args.iters, warmup=args.warmup)

    def row(way, ms, graph, syncs, sent, buf, note) -> None:
        """One table row, printed as soon as it is measured: a way that hangs or breaks the CUDA
        context later leaves the rows before it."""
        if rank == 0:
            print(f"| {way} | {'-' if ms is None else f'{ms:.3f}'} | {graph} | {syncs} | {sent} | {buf} | {note} |",
                  flush=True)

    if rank == 0:
        print(f"== {world} x {torch.cuda.get_device_name(local)}, torch {torch.__version__}; per rank: {args.tokens} "
              f"tokens x {args.dim} bf16, {args.experts} experts top-{args.top_k} ({args.experts // world} a rank), "
              f"random routing; median of {args.iters}, identity experts")
        print("| way | ms per dispatch + combine (eager) | CUDA graph (ms per replay) | host syncs | rows sent "
              "(rank 0) | buffer rows | check |")
        print("|---|---|---|---|---|---|---|", flush=True)
    reference = host_splits(r, group)
    _, counts, _ = sort_by_destination(r)
    moved = counts.sum().item()
    row("host-splits (torchtitan)", timed(lambda: host_splits(r, group), **kw), "no: reads the splits on the host",
        1, moved, f"{n} send, data-sized recv", "")
    for name, cap in (("static dropless (titan)", dropless), (f"static capacity {args.capacity:g}", bounded)):
        fn = lambda cap=cap: static_blocks(r, group, cap)  # noqa: E731
        out = fn()
        dropped = (counts - counts.clamp(max=cap)).sum()
        dist.all_reduce(dropped)
        same = torch.equal(out, reference) if dropped.item() == 0 else None
        ms = timed(fn, **kw)
        ms_graph, why = captured(fn, expect=out, **kw)
        graph = f"yes, {ms_graph:.3f} ms" if why is None else f"no: {why}"
        note = ("== host-splits" if same else "DIFFERS from host-splits") if same is not None \
            else f"{dropped.item()} assignments dropped"
        row(name, ms, graph, 0, world * cap, f"{world * cap} send + recv", note)
    way = "device splits (all_to_all_vdev)"
    try:
        vdev = DeviceSplits(r, group, world)
        out = vdev(r)
        torch.cuda.synchronize()
        same = torch.equal(out, reference)
        row(way, timed(lambda: vdev(r), **kw), "next row", 0, moved, f"{n} send, {vdev.buffer_rows} recv",
            "== host-splits" if same else "DIFFERS from host-splits")
    except Exception as e:  # noqa: BLE001 - unavailable here: one line, the other rows stand
        row(way, None, "-", "-", "-", "-", f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
    else:
        ms_graph, why = captured(lambda: vdev(r), expect=out, **kw)
        row(way + ", captured", ms_graph, "yes" if why is None else f"no: {why}", 0, moved, "", "")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

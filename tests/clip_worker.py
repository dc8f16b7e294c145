"""One rank of tests/test_recipe.py's clipping check: titan's GlobalNormClip against
torch.nn.utils.clip_grad_norm_ on the same gradients as DTensors, bit for bit.

argv: mesh dims as name=size,... ; max_norm (or 'none'). Exit 0 when every case is equal."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan.runtime.grad_clip import GlobalNormClip

dist.init_process_group("gloo")
rank = dist.get_rank()
dims = [(d.split("=")[0], int(d.split("=")[1])) for d in sys.argv[1].split(",")]
max_norm = None if sys.argv[2] == "none" else float(sys.argv[2])
mesh = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
names = [n for n, _ in dims]

# Every mix of placements over the mesh, each parameter a few times, in an order that starts
# with a replicated one (the stack's output placement must not follow the first input).
choices = ["R", "S(0)", "S(1)"]
mixes = [{}]
for name in names:
    mixes = [dict(m, **{name: c}) for m in mixes for c in choices]
mixes = [mixes[0], *reversed(mixes[1:])]
g = torch.Generator().manual_seed(1000 + rank)
failures = 0
for case in range(3):
    placements = [m for m in mixes for _ in range(2)][case:]
    grads = [torch.randn(3 + i % 4, 5, generator=g) * (10.0 ** (i % 3 - 1)) for i in range(len(placements))]
    ours = [t.clone() for t in grads]
    titan_norm = GlobalNormClip(placements, mesh, max_norm=max_norm)(ours)
    params = []
    for t, pl in zip(grads, placements):
        dt = [Shard(int(pl[n][2:-1])) if pl.get(n, "R").startswith("S") else Replicate() for n in names]
        p = DTensor.from_local(torch.zeros_like(t), mesh, dt, run_check=False)
        p.grad = DTensor.from_local(t.clone(), mesh, dt, run_check=False)
        params.append(p)
    if max_norm is None:
        torch_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    same = torch.equal(titan_norm, torch_norm.to_local())
    same &= all(torch.equal(a, p.grad.to_local()) for a, p in zip(ours, params))
    if not same:
        print(f"rank {rank} case {case}: titan {titan_norm.item()!r} torch {torch_norm.to_local().item()!r}",
              flush=True)
        failures += 1
    if max_norm is not None and rank == 0:
        print(f"norm {titan_norm.item():.6f} clipped {titan_norm.item() > max_norm}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)

"""Materialize this rank's parameter shards from a seed and the artifact's init specs.

Each parameter's full tensor is drawn on the run device from its own generator, seeded by
(seed, parameter name), then cut to this rank's shard (zero-padded where an FSDP cut does not
divide). The values therefore do not depend on the layout: every layout (and a single process)
starts from the same global weights.
"""

from __future__ import annotations

import hashlib

import torch

from titan.runtime.contract.rank_record import ParamSpec
from titan.runtime.contract.shard_tensors import shard_of


def param_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_param(spec: dict, shape: list[int], *, fqn: str, seed: int, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32, device=device)
    kind = spec["kind"]
    if kind == "ones":
        return t.fill_(1.0)
    if kind == "zeros":
        return t.zero_()
    g = torch.Generator(device=device)
    g.manual_seed(param_seed(seed, fqn))
    if kind == "normal":
        return t.normal_(0.0, spec["std"], generator=g)
    if kind == "trunc_normal":
        return torch.nn.init.trunc_normal_(t, 0.0, spec["std"], spec["a"], spec["b"], generator=g)
    raise ValueError(f"unknown init kind {kind!r} for {fqn}")


def materialize(param: ParamSpec, *, seed: int, device: torch.device) -> torch.Tensor:
    full = full_param(param.init, list(param.global_shape), fqn=param.fqn, seed=seed, device=device)
    local = shard_of(full, param.slices)
    assert tuple(local.shape) == param.local_shape, (param.fqn, local.shape, param.local_shape)
    return local

"""The debug DeepSeek-V3 as the tests drive it (every tier): global weights drawn as the runtime
draws them, a batch, the eager step on one rank, the same step on expert-parallel gloo ranks
(real processes running deepseek_ep_worker.py), and the ops a step graph must never hold."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from titan.builder.models.deepseek_v3.config import FLAVORS
from titan.builder.models.moe.expert_parallel import set_dispatch
from titan.builder.models.deepseek_v3.init import init_specs
from titan.builder.models.deepseek_v3.model import DeepSeekV3
from titan.runtime.init import full_param

CFG = FLAVORS["debug"]
BATCH, SEQ = 4, 16
WORKER = Path(__file__).with_name("deepseek_ep_worker.py")

# Ops that read a device value on the host, or whose output shape depends on data.
HOST_SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.nonzero_static", "aten.masked_select",
                 "aten.unique", "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
                 "aten.bincount", "aten.histc", "aten._assert_async", "aten._assert_scalar", "aten.repeat_interleave.Tensor",
                 "aten.equal", "aten.is_nonzero", "aten.tolist", "aten._to_cpu", "aten.allclose"}
ALL_TO_ALL = "_c10d_functional.all_to_all_single.default"


def debug_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Global weights drawn as the runtime draws them."""
    shapes = {fqn: list(p.shape) for fqn, p in DeepSeekV3(CFG).named_parameters()}
    return {fqn: full_param(spec, shapes[fqn], fqn=fqn, seed=seed, device=torch.device("cpu"))
            for fqn, spec in init_specs(CFG).items()}


def debug_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)}


def single_rank_step(state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> DeepSeekV3:
    model = DeepSeekV3(CFG)
    model.load_state_dict(state, strict=False)
    model.loss_scale = float(batch["tokens"].numel())
    set_dispatch(model, tokens=batch["tokens"].numel())
    model.last_loss = model(batch["tokens"], batch["labels"])
    model.last_loss.backward()
    return model


def run_ep_ranks(work: Path, state: dict, batch: dict, *, world: int = 2, extra: tuple = ()) -> list[dict]:
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

"""Where a run's state comes from and where it goes: the initial parameters (seeded init, a
Hugging Face checkpoint, or a resumed titan checkpoint) and the checkpoints written while
training. The training loop only calls the hooks here.

Checkpointing imports torch.distributed.checkpoint lazily (runtime/checkpoint.py), so a run
without --checkpoint-dir / --resume imports none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan.runtime import checkpoint
from titan.runtime.hf_record import RECORD, hf_record
from titan.runtime.hf_weights import HFCheckpoint
from titan.runtime.init import materialize

if TYPE_CHECKING:
    from titan.runtime.optim import AdamW
    from titan.runtime.train import RunConfig


class RunState:
    """Checks the run's state options against the artifact (every rank, and the launcher before
    it spawns ranks, so that a mistake is one line), then serves the hooks."""

    def __init__(self, cfg: RunConfig, manifest: dict, params: list[dict], *, device: torch.device | None = None):
        self.cfg, self.manifest, self.params, self.device = cfg, manifest, params, device
        self.hf = None
        self.resume_from: Path | None = None
        self.resumed: dict = {}
        if cfg.checkpoint_every is not None and cfg.checkpoint_dir is None:
            raise ValueError("--checkpoint-every needs --checkpoint-dir DIR (where to write the checkpoints)")
        if cfg.resume:
            if cfg.init_from_hf is not None:
                raise ValueError("--resume continues from a titan checkpoint, --init-from-hf starts from a Hugging "
                                 "Face one: pass only one of them")
            if cfg.checkpoint_dir is None:
                raise ValueError("--resume needs --checkpoint-dir DIR (the directory the earlier run wrote to)")
            self.resume_from = checkpoint.resolve_checkpoint(cfg.checkpoint_dir, flag="--resume --checkpoint-dir",
                                                          step_dir_ok=False)
            self.resumed = checkpoint.read_state(self.resume_from)
            checkpoint.check_matches(self.resumed, self.resume_from, model_config=manifest["model_config"],
                                     params=params)
            checkpoint.check_complete(self.resume_from)
            step = self.resumed["step"]
            if cfg.steps <= step:
                raise ValueError(f"--steps {cfg.steps}: {self.resume_from} is already at step {step}; --steps counts "
                                 f"from the start of training, so pass --steps > {step}")
            if cfg.data is None and self.resumed.get("seed") != cfg.seed:
                raise ValueError(f"--seed {cfg.seed}: the checkpoint was trained on synthetic data of --seed "
                                 f"{self.resumed.get('seed')}; resume with --seed {self.resumed.get('seed')}")
        elif cfg.checkpoint_dir is not None:
            checkpoint.check_fresh(cfg.checkpoint_dir)
        if cfg.init_from_hf is not None:
            record = hf_record(manifest, f"--init-from-hf {cfg.init_from_hf}")
            self.hf = HFCheckpoint(cfg.init_from_hf, record=record)
            for p in params:
                self.hf.check_shape(p)

    @property
    def start_step(self) -> int:
        return self.resumed.get("step", 0)

    def load_param(self, param: dict) -> torch.Tensor:
        """This rank's initial shard of one parameter."""
        if self.resume_from is not None:  # filled by restore(); FSDP padding rows stay zero
            return torch.zeros(param["local_shape"], dtype=getattr(torch, param.get("dtype", "float32")),
                               device=self.device)
        if self.hf is not None:
            return self.hf.read_shard(param, device=self.device)
        return materialize(param, seed=self.cfg.seed, device=self.device)

    def close(self) -> None:
        if self.hf is not None:
            self.hf.close()

    def restore(self, tensors: list[torch.Tensor], optimizer: AdamW) -> int:
        """Load the resumed checkpoint into the live tensors; returns the step to continue after."""
        self.close()
        if self.resume_from is None:
            return 0
        checkpoint.load(self.resume_from, params=self.params, tensors=tensors, optimizer=optimizer)
        return self.start_step

    def _description(self) -> dict:
        m, cfg = self.manifest, self.cfg
        hf_config = self.hf.config if self.hf is not None else self.resumed.get("hf_config")
        return {"model": m.get("model"), "flavor": m.get("flavor"), "model_config": m["model_config"],
                "layout": m["layout"], "world_size": m["world_size"], "dtype": m.get("dtype"),
                "batch_size": m["batch_size"], "seq_len": m["seq_len"], "seed": cfg.seed, "data": cfg.data,
                "lr": cfg.lr, "torch_version": m["torch_version"], "hf_config": hf_config,
                RECORD: m.get(RECORD)}

    def after_step(self, step: int, tensors: list[torch.Tensor], optimizer: AdamW) -> None:
        """Checkpoint every --checkpoint-every steps and at the last step (collective)."""
        cfg = self.cfg
        if cfg.checkpoint_dir is None:
            return
        due = step == cfg.steps or (cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0)
        if due:
            checkpoint.save(cfg.checkpoint_dir, step, params=self.params, tensors=tensors, optimizer=optimizer,
                            description=self._description())

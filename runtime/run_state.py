"""Where a run's state comes from and where it goes: the initial parameters (seeded init, a
Hugging Face checkpoint, or a resumed titan checkpoint) and the checkpoints written while
training. The training loop only calls the hooks here.

Checkpointing imports torch.distributed.checkpoint lazily (runtime/checkpoint.py), so a run
without --checkpoint-dir / --resume imports none of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan.runtime import checkpoint
from titan.runtime.contract.hf_record import RECORD
from titan.runtime.data import check_token_file, describe_token_file
from titan.runtime.hf_weights import HFCheckpoint
from titan.runtime.contract.rank_record import ParamSpec
from titan.runtime.init import materialize
from titan.runtime.run_paths import check_option_combinations, check_run_paths
from titan.runtime.recipe import Recipe

if TYPE_CHECKING:
    from titan.runtime.contract.manifest import Manifest
    from titan.runtime.contract.rank_record import BufferSpec
    from titan.runtime.optim import AdamW
    from titan.runtime.run_config import RunConfig


def _whole(buffer: BufferSpec) -> ParamSpec:
    """A buffer (every rank holds all of it) as a parameter record, to read it from a checkpoint."""
    return ParamSpec(fqn=buffer.fqn, global_shape=buffer.shape, local_shape=buffer.shape, placements={}, slices=(),
                     init={}, dtype=buffer.dtype)


class RunOptionError(ValueError):
    """The run's options do not fit the artifact or the checkpoint. Every rank finds the same
    one, so only rank 0 prints it (titan-run's launcher finds it before any rank starts)."""


def _data_name(data: str | None) -> str:
    return "none (synthetic tokens)" if data is None else str(data)


class RunState:
    """Checks the run's options against the artifact and the checkpoint: the one validation of
    a run, made by every rank (spawned by titan-run or by torchrun) and by titan-run before it
    spawns them, so that a mistake is one line. Then serves the state hooks."""

    def __init__(self, cfg: RunConfig, manifest: Manifest, params: tuple[ParamSpec, ...], *,
                 buffers: tuple[BufferSpec, ...] = (),
                 device: torch.device | None = None, model_params: tuple[ParamSpec, ...] | None = None,
                 model_buffers: tuple[BufferSpec, ...] | None = None):
        """`params`, `buffers`: this rank's; `model_params`, `model_buffers`: the whole model's,
        which a checkpoint describes (a pipeline stage's rank holds only its stages': default
        `params`, `buffers`)."""
        self.cfg, self.manifest, self.params, self.device = cfg, manifest, params, device
        self.model_params = params if model_params is None else model_params
        self.model_buffers = buffers if model_buffers is None else model_buffers
        self.hf = None
        self.resume_from: Path | None = None
        self.resumed: dict = {}
        self.notes: list[str] = []
        try:
            self._check(cfg, manifest, params, self.model_buffers)
        except RunOptionError:
            raise
        except ValueError as e:
            raise RunOptionError(str(e)) from None

    def _check(self, cfg: RunConfig, manifest: Manifest, params: tuple[ParamSpec, ...],
               buffers: tuple[BufferSpec, ...]) -> None:
        check_option_combinations(steps=cfg.steps, checkpoint_dir=cfg.checkpoint_dir,
                                  checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                                  init_from_hf=cfg.init_from_hf)
        check_run_paths(data=cfg.data, checkpoint_dir=cfg.checkpoint_dir, resume=cfg.resume,
                        init_from_hf=cfg.init_from_hf, metrics=cfg.metrics, tensorboard=cfg.tensorboard)
        for flag, given, built in (("--batch-size", cfg.batch_size, manifest.batch_size),
                                   ("--seq-len", cfg.seq_len, manifest.seq_len)):
            if given is not None and given != built:
                raise ValueError(f"{flag} {given} differs from the artifact's {built} (it shapes the graphs); "
                                 f"rebuild with titan-build {flag} {given}, or drop {flag}")
        self.recipe = Recipe.for_run(cfg, manifest)
        if manifest.pipeline is not None and cfg.val_data is not None:
            raise ValueError("--val-data: validating a pipeline artifact is not built yet; drop --val-data (or build "
                             "the artifact without --pp)")
        if cfg.val_data is None and (cfg.val_every is not None or cfg.val_steps != 1):
            raise ValueError("--val-every / --val-steps need --val-data FILE (a titan-data token file of held-out text)")
        if cfg.val_data is not None:
            self.notes += check_token_file(cfg.val_data, dtype=cfg.data_dtype, manifest=manifest, steps=cfg.val_steps)
        if cfg.data is not None:
            self.notes += check_token_file(cfg.data, dtype=cfg.data_dtype, manifest=manifest,
                                           steps=cfg.steps * self.recipe.micro_batches)
        if cfg.resume:
            self.resume_from = checkpoint.resolve_checkpoint(cfg.checkpoint_dir, flag="--resume --checkpoint-dir",
                                                          step_dir_ok=False)
            self.resumed = checkpoint.read_state(self.resume_from)
            checkpoint.check_matches(self.resumed, self.resume_from, model_config=manifest.model_config,
                                     params=self.model_params, buffers=buffers)
            checkpoint.check_complete(self.resume_from)
            step = self.resumed["step"]
            if cfg.steps <= step:
                raise ValueError(f"--steps {cfg.steps}: {self.resume_from} is already at step {step}; --steps counts "
                                 f"from the start of training, so pass --steps > {step}")
            changed = self._changed_settings()
            if changed and not cfg.resume_with_changes:
                raise ValueError(f"{self.resume_from} was trained with other settings: {'; '.join(changed)}; "
                                 "pass its values to continue that run, or --resume-with-changes to go on with these")
        else:
            if cfg.checkpoint_dir is not None:
                checkpoint.check_fresh(cfg.checkpoint_dir)
            if cfg.metrics is not None and Path(cfg.metrics).is_file() and Path(cfg.metrics).stat().st_size:
                raise ValueError(f"--metrics {cfg.metrics} already holds an earlier run's steps (titan-run never "
                                 "truncates one); delete it or choose another file, or --resume that run")
        if cfg.init_from_hf is not None:
            record = manifest.hf_record(f"--init-from-hf {cfg.init_from_hf}")
            self.hf = HFCheckpoint(cfg.init_from_hf, record=record)
            for p in [*params, *(_whole(b) for b in buffers if self.hf.holds(b.fqn))]:
                self.hf.check_shape(p)

    def _settings(self) -> dict:
        """The run's own settings that decide its losses: recorded in each checkpoint and
        compared on --resume. The artifact's choices (layout, batch shape, dtype) may change on a
        resume: checkpoints reshard exactly, and picking another artifact is deliberate."""
        cfg = self.cfg
        return {"--seed": cfg.seed, "--data": None if cfg.data is None else os.path.abspath(cfg.data), "--lr": cfg.lr,
                **self.recipe.settings()}

    def _changed_settings(self) -> list[str]:
        recorded = self.resumed.get("settings")
        if recorded is None:  # written before settings were recorded: what it does record
            r = self.resumed
            recorded = {"--seed": r.get("seed"), "--lr": r.get("lr"),
                        "--data": None if r.get("data") is None else os.path.abspath(r["data"])}
        changed = []
        for name, now in self._settings().items():
            if name in recorded and recorded[name] != now:
                then = recorded[name]
                if name == "--data":
                    then, now = _data_name(then), _data_name(now)
                changed.append(f"{name} {now} here, {then} there")
        return changed

    def params_from(self) -> str:
        """Where the initial parameters come from, in a few words."""
        if self.resume_from is not None:
            return f"to be filled from the checkpoint at step {self.start_step}"
        if self.hf is not None:
            return f"from the Hugging Face weights in {self.cfg.init_from_hf}"
        return f"seeded init, seed {self.cfg.seed}"

    def origin(self) -> str:
        """What the run starts from and trains on, for its first lines."""
        cfg = self.cfg
        if self.resume_from is not None:
            start = (f"resuming from {self.resume_from} (step {self.start_step}), to train steps "
                     f"{self.start_step + 1}-{cfg.steps}")
        elif self.hf is not None:
            start = f"the Hugging Face weights in {cfg.init_from_hf}, to train steps 1-{cfg.steps}"
        else:
            start = f"fresh weights (seeded init, seed {cfg.seed}), to train steps 1-{cfg.steps}"
        data = (f"synthetic tokens (seed {cfg.seed})" if cfg.data is None
                else describe_token_file(cfg.data, dtype=cfg.data_dtype, vocab_size=self.manifest.vocab_size))
        where = "" if cfg.checkpoint_dir is None else (
            f"; checkpoints to {cfg.checkpoint_dir}" + (f" every {cfg.checkpoint_every} steps and" if cfg.checkpoint_every
                                                        else "") + " at the last step")
        return f"{start}; data: {data}{where}"

    @property
    def start_step(self) -> int:
        return self.resumed.get("step", 0)

    def load_param(self, param: ParamSpec) -> torch.Tensor:
        """This rank's initial shard of one parameter."""
        if self.resume_from is not None:  # filled by restore(); FSDP padding rows stay zero
            return torch.zeros(param.local_shape, dtype=getattr(torch, param.dtype),
                               device=self.device)
        if self.hf is not None:
            return self.hf.read_shard(param, device=self.device)
        return materialize(param, seed=self.cfg.seed, device=self.device)

    def load_buffer(self, buffer: BufferSpec) -> torch.Tensor | None:
        """A model buffer's initial value when the Hugging Face checkpoint holds it (a MoE
        balancing bias), else None (zeros; a resumed run restores its buffers)."""
        if self.resume_from is None and self.hf is not None and self.hf.holds(buffer.fqn):
            return self.hf.read_shard(_whole(buffer), device=self.device)
        return None

    def close(self) -> None:
        if self.hf is not None:
            self.hf.close()

    def restore(self, tensors: list[torch.Tensor], optimizer: AdamW, *,
                buffers: dict[str, torch.Tensor] | None = None) -> int:
        """Load the resumed checkpoint into the live tensors (and the model's buffers); returns
        the step to continue after."""
        self.close()
        if self.resume_from is None:
            return 0
        checkpoint.load(self.resume_from, params=self.params, tensors=tensors, optimizer=optimizer, buffers=buffers)
        return self.start_step

    def _description(self) -> dict:
        m, cfg = self.manifest, self.cfg
        hf_config = self.hf.config if self.hf is not None else self.resumed.get("hf_config")
        return {"model": m.model, "flavor": m.flavor, "model_config": m.model_config,
                "layout": m.layout.as_dict(), "world_size": m.world_size, "dtype": m.dtype,
                "batch_size": m.batch_size, "seq_len": m.seq_len, "seed": cfg.seed, "data": cfg.data,
                "lr": cfg.lr, "torch_version": m.torch_version, "hf_config": hf_config,
                RECORD: None if m.hf_checkpoint is None else m.hf_checkpoint.to_json(), "settings": self._settings(),
                "config": cfg.as_dict()}

    def after_step(self, step: int, tensors: list[torch.Tensor], optimizer: AdamW, *,
                   buffers: dict[str, torch.Tensor] | None = None) -> Path | None:
        """Checkpoint every --checkpoint-every steps and at the last step (collective); returns
        the step directory written, if any."""
        cfg = self.cfg
        if cfg.checkpoint_dir is None:
            return None
        due = step == cfg.steps or (cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0)
        if not due:
            return None
        return checkpoint.save(cfg.checkpoint_dir, step, params=self.params, tensors=tensors, optimizer=optimizer,
                               description=self._description(), buffers=buffers, described=self.model_params,
                               described_buffers=self.model_buffers)

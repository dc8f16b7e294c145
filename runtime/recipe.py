"""A run's training recipe, resolved from its RunConfig and the artifact: the LR schedule,
AdamW's hyperparameters, gradient clipping and how many micro-batches make an optimizer step.

Gradient accumulation: each micro-batch's loss is divided by the number of micro-batches (the
graph's loss is already the sum over the micro-batch's tokens divided by the tokens of all
data-parallel ranks), so the gradients summed over micro-batches are those of the mean loss
over the global batch's tokens. The backward graph gets the division as its seed,
`ones / micro_batches`, exactly what autograd feeds it for `(loss / micro_batches).backward()`.
Data-parallel reductions run once per micro-batch: they are inside each micro-batch's backward
graph, as they are inside eager's SimpleFSDP / DTensor backward, so both sum the same reduced
gradients in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan.runtime.lr_schedule import LRSchedule

if TYPE_CHECKING:
    from titan.runtime.contract.manifest import Manifest
    from titan.runtime.run_config import RunConfig


def adamw_options(cfg: RunConfig) -> dict:
    """AdamW's keyword arguments besides lr, as torch.optim.AdamW takes them."""
    return dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def micro_batches(cfg: RunConfig, manifest: Manifest) -> int:
    """Micro-batches per optimizer step from --accumulation-steps or --global-batch-size; a
    pipeline artifact's step is its schedule's micro-batches (the build chose them)."""
    per_micro = manifest.batch_size * manifest.dp_degree
    if manifest.pipeline is not None:
        built = manifest.microbatches
        if cfg.accumulation_steps != 1 or cfg.global_batch_size not in (None, per_micro * built):
            raise ValueError(f"this pipeline artifact's step is its {built} micro-batches of {manifest.batch_size} "
                             f"sequences per data-parallel rank ({per_micro * built} sequences); drop "
                             "--accumulation-steps / --global-batch-size, or rebuild with titan-build --microbatches")
        return built
    if cfg.global_batch_size is None:
        return cfg.accumulation_steps
    if cfg.global_batch_size % per_micro:
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} is not a multiple of the artifact's "
                         f"{manifest.batch_size} sequences x {manifest.dp_degree} data-parallel ranks = {per_micro}; "
                         f"pass a multiple of {per_micro}")
    n = cfg.global_batch_size // per_micro
    if cfg.accumulation_steps not in (1, n):
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} means {n} accumulation steps, not "
                         f"--accumulation-steps {cfg.accumulation_steps}; pass only one of them")
    return n


@dataclass(frozen=True, kw_only=True)
class Recipe:
    schedule: LRSchedule
    """Each optimizer step's learning rate."""
    adamw: dict
    """betas, eps, weight_decay."""
    max_norm: float | None
    """Global-norm clip (None: the norm is measured, nothing is clipped)."""
    micro_batches: int
    """Micro-batches per optimizer step."""

    @staticmethod
    def for_run(cfg: RunConfig, manifest: Manifest) -> Recipe:
        schedule = LRSchedule.for_run(lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                                      decay_type=cfg.decay_type, decay_ratio=cfg.decay_ratio,
                                      min_lr_factor=cfg.min_lr_factor)
        return Recipe(schedule=schedule, adamw=adamw_options(cfg), max_norm=cfg.max_norm,
                      micro_batches=micro_batches(cfg, manifest))

    @staticmethod
    def constant(lr: float) -> Recipe:
        """A constant LR with RunConfig's AdamW defaults, one micro-batch, no clipping."""
        from titan.runtime.run_config import RunConfig
        return Recipe(schedule=LRSchedule.for_run(lr=lr, steps=0, warmup_steps=0, decay_type="none", decay_ratio=None,
                                                  min_lr_factor=0.0),
                      adamw=adamw_options(RunConfig()), max_norm=None, micro_batches=1)

    def settings(self) -> dict:
        """What decides the losses beyond seed, data and --lr, by the flag that sets it: recorded
        in checkpoints, compared on resume (runtime/run_state.py)."""
        shape = self.schedule.as_dict()
        named = {"--warmup-steps": shape["warmup_steps"], "--decay-type": shape["decay_type"]}
        if "decay_steps" in shape:  # a decaying schedule also depends on --steps and --decay-ratio
            named.update({"--min-lr-factor": shape["min_lr_factor"],
                          "decay steps (--steps, --decay-ratio)": shape["decay_steps"],
                          "stable steps (--steps, --decay-ratio)": shape["stable_steps"]})
        betas = self.adamw["betas"]
        named.update({"--beta1": betas[0], "--beta2": betas[1], "--eps": self.adamw["eps"],
                      "--weight-decay": self.adamw["weight_decay"], "--max-norm": self.max_norm,
                      "micro-batches per step (--accumulation-steps, --global-batch-size)": self.micro_batches})
        return named

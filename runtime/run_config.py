"""A run's configuration: every titan-run option, defined once.

cli/config_options.py makes each field a titan-run option (and a key of `--config job.toml`,
section [run]); the field's docstring is its help. runtime/run_state.py checks a config
against the artifact and the checkpoint. A config is data: it does no work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

from titan.runtime.common.config_fields import setting
from titan.runtime.kernels.artifact_trust import KernelTrust


@dataclass(kw_only=True, slots=True)
class RunConfig:
    steps: int = setting(20, check="non_negative")
    """Train up to this optimizer step (counted from the start, also when resuming); 0 with --checkpoint-dir only checkpoints the initial weights."""
    lr: float = setting(8e-4, check="positive_float")
    """Peak AdamW learning rate (the schedule's factor multiplies it)."""
    warmup_steps: int = setting(0, check="non_negative")
    """Steps of linear warmup: step k (from 1) runs at k / warmup_steps of --lr."""
    decay_type: Literal["none", "linear", "cosine", "sqrt"] = "none"
    """Decay after warmup (and the stable phase) down to --min-lr-factor: none keeps --lr; sqrt is 1-sqrt."""
    decay_ratio: float | None = setting(None, check="fraction")
    """Fraction of --steps that decay, at the end (warmup-stable-decay); default: every step after warmup."""
    min_lr_factor: float = setting(0.0, check="fraction")
    """The decay ends at this fraction of --lr."""
    beta1: float = setting(0.9, check="fraction")
    """AdamW beta1."""
    beta2: float = setting(0.95, check="fraction")
    """AdamW beta2."""
    eps: float = setting(1e-8, check="positive_float")
    """AdamW epsilon."""
    weight_decay: float = setting(0.1, check="non_negative_float")
    """AdamW decoupled weight decay."""
    max_norm: float | None = setting(None, check="positive_float")
    """Clip the gradients to this global L2 norm (over every parameter of every rank), as clip_grad_norm_ does; default: no clipping."""
    accumulation_steps: int = setting(1, check="positive")
    """Micro-batches per optimizer step; the loss is the mean over all of their tokens."""
    global_batch_size: int | None = setting(None, check="positive")
    """Sequences per optimizer step over all ranks: the artifact's batch size x data-parallel degree x accumulation steps (sets those steps)."""
    val_data: str | None = setting(None, check="file")
    """Token file (titan-data) of held-out sequences: report their mean loss (val_loss), forward only."""
    val_every: int | None = setting(None, check="positive")
    """Validate every K optimizer steps (default: at the last step only)."""
    val_steps: int = setting(1, check="positive")
    """Batches of --val-data per validation (the same ones each time)."""
    seed: int = setting(0, check="seed")
    """Seed for initial weights and synthetic data."""
    batch_size: int | None = setting(None, check="positive")
    """Must equal the artifact's (it shapes the graphs)."""
    seq_len: int | None = setting(None, check="positive")
    """Must equal the artifact's (it shapes the graphs)."""
    data: str | None = setting(None, check="file")
    """Flat token file written by titan-data (default: synthetic tokens)."""
    data_dtype: Literal["uint16", "uint32"] | None = None
    """Token file element type (default: from its titan-data sidecar, else uint16)."""
    metrics: str | None = setting(None, check="file")
    """Write one JSON object per step to this new file, after a header line with the run's config (--resume rewrites it from the checkpoint's step)."""
    tensorboard: str | None = setting(None, check="dir")
    """Write TensorBoard scalars (loss, lr, grad_norm, tokens/s, step time, GPU peak memory) into this directory."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run: auto is CUDA when this host has GPUs."""
    deterministic: bool = False
    """Deterministic kernels only (GPU)."""
    timeout_s: float = setting(300.0, check="timeout", flag="--timeout")
    """Seconds a rank waits in a collective (or for its peers) before the job fails."""
    cuda_graphs: bool = True
    """On GPU, capture forward + backward in a CUDA graph and replay it."""
    pp_gather_per_step: bool = True
    """A pipeline's stages all-gather their (dp-shard) parameters once per step, before the first micro-batch, and hold them until the last backward (bitwise the same; more resident memory under --ac): off, every micro-batch gathers again, as the stage graphs do."""
    pp_reduce_per_step: bool = False
    """Numerics change: a pipeline's stages sum their unsharded gradients over the step's micro-batches and reduce-scatter them once, after the last backward (fewer collectives; each stage holds its unsharded fp32 gradients for the step; the sum's order differs, so not bitwise the reference)."""
    compile_in_background: bool = True
    """On a GPU, a first run compiles the exact kernels this host lacks in worker processes while its first steps run on eager's kernels (bitwise the same numbers, slower until the kernels are in); off: compile them all before the first step."""
    fused_adamw: bool = True
    """On GPU, one AdamW kernel per parameter (bitwise the op-by-op update; needs triton)."""
    init_from_hf: str | None = setting(None, check="dir")
    """Load the initial weights from a Hugging Face directory (config.json + safetensors)."""
    checkpoint_dir: str | None = setting(None, check="dir")
    """Write DCP checkpoints (step-NNNNNNNN/ directories) here, at the last step."""
    checkpoint_every: int | None = setting(None, check="positive")
    """Also checkpoint every K steps."""
    resume: bool = False
    """Continue from the latest complete checkpoint in --checkpoint-dir."""
    resume_with_changes: bool = False
    """With --resume: accept a seed, data file, learning-rate schedule or optimizer setting other than the checkpoint's."""
    quiet: bool = setting(False, cli=False)
    """Print no step lines (tests and benchmarks)."""
    kernel_trust: KernelTrust = setting(KernelTrust(), cli=False)
    """Whose compiled kernels in the artifact this run loads (--trust, --trust-unsigned-kernels:
    options of their own, since they are about trust, not the job: never read from a --config file)."""

    def as_dict(self) -> dict:
        """The effective configuration, as recorded in checkpoints and the metrics header."""
        return asdict(self)


RUN_FIELDS = tuple(f.name for f in fields(RunConfig))
